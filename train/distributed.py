"""Multi-process training: FSDP units and gathering the full head; every rank's RNG state in checkpoints.

Fully sharded training: which modules are FSDP units, and gathering the full head for checkpoints and exports.

Without a wrap policy FSDP makes the whole LightningModule one unit: the frozen target and the head are gathered
whole on every rank and nothing is sharded in practice. Here each decoder layer of the target is its own unit and
the draft head is another (:func:`wrap_units`); what remains (the target's embedding, final norm and ``lm_head``) is
the root unit. The decoder-layer class is read from the target at run time (:func:`decoder_layer_class`), so one
config serves Llama, Qwen, Mistral, ... targets.

``trainer=fsdp`` (:class:`DraftFSDPStrategy`, Lightning's FSDP with that policy) runs on GPUs; the same units are
sharded by torch's ``fully_shard`` in :func:`fully_shard_units`, which runs on CPUs with gloo as well.

Data parallel resume: Lightning writes rank 0's checkpoint only, so the RNG states of the other ranks were lost and
every rank resumed from rank 0's (heads that draw random numbers while training, DFlash's anchors, then diverged
from an uninterrupted run). :func:`rng_states_of_all_ranks` gathers them into the checkpoint and
:func:`rng_state_of_this_rank` picks this rank's back.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

from torch import nn

try:
    from lightning.pytorch.strategies import FSDPStrategy
except ImportError:  # pragma: no cover - Lightning is a dependency; this keeps the module importable without it
    FSDPStrategy = object  # type: ignore[assignment,misc]


def decoder_layer_class(model: nn.Module) -> type | None:
    """The class of the target's decoder layers: the element class of the ``nn.ModuleList`` holding
    ``config.num_hidden_layers`` blocks (Hugging Face's ``model.layers``); None when there is no such list."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and (n is None or len(m) == n):
            kinds = {type(x) for x in m}
            if len(kinds) == 1:
                return kinds.pop()
    return None


def wrap_units(target: Any, head: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units, innermost first: every decoder layer of the target, then the head."""
    model = target.model if hasattr(target, "model") else target
    cls = decoder_layer_class(model)
    layers = [m for m in model.modules() if cls is not None and isinstance(m, cls)]
    return [*layers, head]


def wrap_policy(target: Any, head: nn.Module):
    """FSDP's ``auto_wrap_policy`` for :func:`wrap_units`: the decoder-layer class and the head's class."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    classes = {type(m) for m in wrap_units(target, head)}
    return ModuleWrapPolicy(classes)


def fully_shard_units(target: Any, head: nn.Module, root: nn.Module, mesh: Any = None) -> nn.Module:
    """torch's ``fully_shard`` (FSDP2) on each of :func:`wrap_units` and then on ``root`` (the module holding both)."""
    from torch.distributed.fsdp import fully_shard

    for unit in wrap_units(target, head):
        fully_shard(unit, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return root


class DraftFSDPStrategy(FSDPStrategy):  # type: ignore[misc,valid-type]
    """Lightning's FSDPStrategy whose ``auto_wrap_policy`` is :func:`wrap_policy` of the module's target and head,
    resolved when the model is set up (the decoder-layer class is the target's, known only then)."""

    def _configure_launcher(self) -> None:
        if self.root_device.type == "cpu":  # torch's FSDP (1) refuses CPUs: say so in the Trainer, before ranks start
            from data.errors import UserError

            raise UserError("trainer=fsdp runs on GPUs only (torch's FSDP needs an accelerator); on CPUs use trainer=ddp "
                            "trainer.accelerator=cpu")
        super()._configure_launcher()

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if "auto_wrap_policy" not in self.kwargs and hasattr(model, "target") and hasattr(model, "head"):
            self.kwargs["auto_wrap_policy"] = wrap_policy(model.target, model.head)
        return super()._setup_model(model)


def is_fsdp(module: nn.Module) -> bool:
    """Whether FSDP (1 or 2) wraps ``module`` or any module inside it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        FSDPModule = ()  # type: ignore[assignment]
    return any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in module.modules())


@contextmanager
def full_parameters(model: nn.Module | None, writeback: bool = False) -> Iterator[None]:
    """The full (unsharded) parameters on every rank inside the block: every rank must enter it (a collective).
    ``writeback``: changes made inside (loading the best checkpoint) are sharded back on exit. A model not
    wrapped by FSDP1 passes through unchanged."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if model is not None and any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        ctx = FullyShardedDataParallel.summon_full_params(model, writeback=writeback, rank0_only=False, with_grads=False)
    else:
        ctx = nullcontext()
    with ctx:
        yield


def export_head(head: nn.Module, out_dir: Any, train_config: dict | None, rank_zero: bool) -> Any:
    """``head.export`` of the full head: call it on every rank. Under FSDP2 the sharded tensors (DTensors) are gathered
    on every rank (a collective) and rank 0 writes them; a plain head (or one inside :func:`full_parameters`) exports
    as it is. Returns the export folder on rank 0, None elsewhere."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        DTensor = ()  # type: ignore[assignment]
    state = head.state_dict()
    sharded = any(isinstance(v, DTensor) for v in state.values())
    if sharded:
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}
    if not rank_zero:
        return None
    if not sharded:
        return head.export(out_dir, train_config=train_config)
    # export reads the gathered tensors and names the head's own class (fully_shard makes it an FSDP<Class>), this once
    sharded_cls = type(head)
    head.__dict__["state_dict"] = lambda *a, **k: state
    head.__class__ = unsharded_class(sharded_cls)
    try:
        return head.export(out_dir, train_config=train_config)
    finally:
        head.__class__ = sharded_cls
        del head.__dict__["state_dict"]


def unsharded_class(cls: type) -> type:
    """The module's own class behind FSDP2's ``FSDP<Class>`` (``cls`` itself when it is not one)."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def rng_states_of_all_ranks(states: dict) -> list[dict]:
    """This rank's RNG ``states`` gathered from every rank (a collective: every rank saving a checkpoint calls it);
    ``[states]`` in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [states]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, states)
    return out


def rng_state_of_this_rank(ckpt: dict) -> dict | None:
    """This rank's RNG states from a checkpoint: ``rng_states_per_rank[rank]`` when it has as many ranks as this
    run, else the single-process ``rng_states`` (a checkpoint of another world size: rank 0's for every rank)."""
    import torch.distributed as dist

    per_rank = ckpt.get("rng_states_per_rank")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(per_rank, list) and len(per_rank) == world:
        return per_rank[rank]
    return ckpt.get("rng_states")
