"""The frozen target: any Hugging Face causal LM (by name or path), the embedded target, or a given module.

Tap-layer convention (fixed here, once): a tap is named by *decoder-layer index* ``i`` (0-based) and
means the output of decoder layer ``i``, recorded as the residual stream *entering* layer ``i + 1`` by a forward
pre-hook. That is what serving engines collect for EAGLE-3 (vLLM and SGLang keep ``hidden_states + residual``
before each layer they list), so a head sees in training exactly what an engine hands it. In Hugging Face
``output_hidden_states``, index 0 is the embedding output and index ``i + 1`` the output of layer ``i``:
:func:`hf_hidden_index` is the only conversion. The output of the last layer (tap ``L - 1``) enters no layer: no
engine collects it (Hugging Face's last ``hidden_states`` entry is after the final norm), so heads that read taps
may not use it (:func:`check_collectable`). The last hidden state is the final-norm output that feeds
``lm_head``, which engines hand EAGLE-1-style heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from data.errors import UserError
from models.cpu_linear import choose_model_kernels, pack_linears
from models.gguf import SMOLLM2, converted_dir

EMBEDDED = "embedded"
EMBEDDED_PATH = Path(__file__).resolve().parent.parent / "assets" / "target"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def hf_hidden_index(layer: int) -> int:
    """Index into Hugging Face ``hidden_states`` of the output of decoder layer ``layer``."""
    return layer + 1


def rope_theta(config) -> float:
    """The RoPE base of an HF config: transformers 5 keeps it in ``rope_parameters``, older configs at top level."""
    rp = getattr(config, "rope_parameters", None) or {}
    return float(getattr(config, "rope_theta", None) or (rp.get("rope_theta") if isinstance(rp, dict) else None) or 10000.0)


def check_collectable(taps: Sequence[int], num_layers: int, who: str = "tap_layers") -> None:
    """A UserError when ``taps`` include the last layer's output (``num_layers - 1``), which no serving engine
    collects: vLLM and SGLang capture the residual stream entering a decoder layer, so the outputs of layers
    0..L-2 only. For heads that read taps (EAGLE-3, DFlash, DSpark); heads reading the final-norm state need none."""
    last = num_layers - 1
    if last in [int(i) for i in taps]:
        ok = [i for i in taps if int(i) != last]
        raise UserError(f"{who}={list(taps)}: tap {last} is the output of the last decoder layer, which no serving engine "
                        f"collects (they capture the input of layers 1..{last}); use taps within 0..{last - 1} "
                        f"(e.g. {sorted(set(ok + [last - 1]))})")


def default_tap_layers(num_layers: int, method: str = "eagle3", n_taps: int = 5) -> list[int]:
    """Default tap layers (decoder-layer indices) of a drafter family (its ``tap_method``).

    eagle3: ``[1, L//2 - 1, L - 4]`` (on shallow targets where these collide, the next layer up: L=6 →
    [1, 2, 3]), never above L-2 (:func:`check_collectable`; L=4 → [0, 1, 2]). dflash: ``n_taps`` spread uniformly over layers 1..L-3
    (Qwen3-8B, L=36 → [1, 9, 17, 25, 33]). last: the top layer ``[L - 1]`` (EAGLE-1's feature).
    """
    L = num_layers
    if method == "eagle3":
        taps = [1, L // 2 - 1, L - 4]
        for i in (1, 2):  # shallow targets: where the rule collides, take the next layer up
            taps[i] = max(taps[i], taps[i - 1] + 1)
        taps = sorted({max(0, min(L - 2, i)) for i in taps})
        if len(taps) < 3:  # shallower still (L < 5): the three highest layers engines collect
            taps = list(range(max(0, L - 4), max(1, L - 1)))
        return taps
    if method == "dflash":
        lo, hi = 1, max(1, L - 3)
        if n_taps == 1:
            return [lo]
        return sorted({round(lo + k * (hi - lo) / (n_taps - 1)) for k in range(n_taps)})
    if method == "last":
        return [L - 1]
    raise UserError(f"tap method {method!r}: use eagle3, dflash or last")


def resolve_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """``auto``: float32 on a CPU (bf16 is no faster for these models on CPUs without AMX, and numerically
    exact decoding needs fp32), bfloat16 on a GPU (``device``; None: a GPU when one is visible); otherwise one
    of :data:`DTYPES`."""
    if dtype == "auto":
        gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if gpu else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"target.dtype={dtype!r}: use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    """``auto``: the first GPU when one is visible, else the CPU; otherwise a torch device string."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device={device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but no GPU is visible; use device=cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device={device!r}: only {torch.cuda.device_count()} GPU(s) visible (cuda:0..)")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a timer reads the work done; a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_path(name_or_path: str) -> str:
    """``embedded`` → the shipped model directory; ``smollm2`` or a ``*.gguf`` file → its converted HF folder
    (:mod:`models.gguf`, converted once); anything else is passed to ``from_pretrained``."""
    if name_or_path == SMOLLM2 or str(name_or_path).endswith(".gguf"):
        return str(converted_dir(name_or_path))
    if name_or_path == EMBEDDED:
        if not (EMBEDDED_PATH / "config.json").exists():
            raise UserError(f"embedded target missing at {EMBEDDED_PATH}; rebuild it with `python -m train.embedded_target`")
        return str(EMBEDDED_PATH)
    p = Path(name_or_path)
    if (name_or_path.startswith((".", "/", "~")) or p.exists()) and not (p.expanduser() / "config.json").exists():
        raise UserError(f"target {name_or_path!r}: no such model directory (expected a folder with config.json)")
    return str(p.expanduser()) if p.expanduser().exists() else name_or_path


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    path = resolve_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"target {name_or_path!r}: could not load its tokenizer ({str(e).splitlines()[0]})") from None


class _Grab:
    """A forward pre-hook keeping the hidden state entering a module as the target's tap ``layer`` (a class, not a
    closure, so that a target pickles for multi-process training)."""

    def __init__(self, target: "FrozenTarget", layer: int):
        self.target, self.layer = target, layer

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        store = self.target._taps  # None outside FrozenTarget.forward: a direct call of the model keeps nothing
        if store is not None:
            store[self.layer] = args[0] if args else kwargs["hidden_states"]  # [B, T, d] residual stream entering it


@dataclass
class TargetOutput:
    """What the target hands a draft head. Shapes: B batch, T tokens, n taps, d hidden, V vocabulary."""

    tap_states: torch.Tensor          # [B, T, n_taps, d]
    last_state: torch.Tensor          # [B, T, d]  final-norm output (feeds lm_head)
    logits: torch.Tensor | None = None  # [B, T, V] where the forward was asked for them (or all_logits made them)
    lm_head: Any = None               # the target's output layer: logits on demand, at every row or at some

    @torch.no_grad()
    def all_logits(self) -> torch.Tensor:
        """The target's logits at every position [B, T, V], computed once from ``last_state`` if not given."""
        if self.logits is None:
            self.logits = self._head()(self.last_state)
        return self.logits

    @torch.no_grad()
    def logits_at(self, b: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits at rows ``(b[i], t[i])`` [M] → (``z`` [U, V], ``inv`` [M]): row i's logits are
        ``z[inv[i]]``. Without ``logits`` only the U distinct rows go through ``lm_head``: a loss that reads some
        rows (the block drafters' scored slots) pays for those, not for B·T·d·V multiply-adds."""
        if self.logits is not None:
            return self.logits[b, t], torch.arange(b.numel(), device=b.device)
        T = self.last_state.shape[1]
        uniq, inv = torch.unique(b * T + t, return_inverse=True)  # [U], [M]
        return self._head()(self.last_state.flatten(0, 1)[uniq]), inv

    def _head(self) -> Any:
        if self.lm_head is None:
            raise ValueError("TargetOutput has neither logits nor lm_head: build it with lm_head=target.model.lm_head")
        return self.lm_head


class FrozenTarget(nn.Module):
    """A causal LM frozen in eval mode, returning tap hidden states, the last hidden state and (optionally) logits.

    ``device``: where the weights live (``auto``, ``cpu``, ``cuda``, ``cuda:N``; :func:`resolve_device`). The tap
    states are recorded by forward pre-hooks on the decoder layers after the taps (the input of layer ``i + 1``;
    the last layer's output at the final norm's input), so a forward keeps the tapped layers' states only, not
    every layer's as ``output_hidden_states`` does."""

    def __init__(self, name_or_path: str | None = EMBEDDED, tap_layers: Sequence[int] | None = None,
                 dtype: str = "float32", model: nn.Module | None = None, tap_method: str = "eagle3",
                 fast_linear: bool | str = True, device: str = "cpu"):
        super().__init__()
        dev = resolve_device(str(device))
        if model is None:
            if not name_or_path:
                raise UserError("target: give name_or_path (a model name, a path, or 'embedded')")
            from transformers import AutoModelForCausalLM

            torch_dtype = resolve_dtype(dtype, dev)
            path = resolve_path(name_or_path)
            try:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
            except OSError as e:
                raise UserError(f"target {name_or_path!r}: could not load ({str(e).splitlines()[0]})") from None
        elif dtype in DTYPES or dtype == "auto":
            model = model.to(resolve_dtype(dtype, dev))
        self.name_or_path = name_or_path or getattr(model.config, "_name_or_path", "module")
        self.model = model.to(dev).eval().requires_grad_(False)
        if fast_linear not in (True, False, "packed"):
            raise UserError(f"target.fast_linear={fast_linear!r}: true (kernels timed here), packed or false")
        # on a CPU only: each linear layer's product by the kernel timed fastest here per row count (models.cpu_linear);
        # "packed": oneDNN's packed fp32 weight for every row count; false: F.linear. Elsewhere (a GPU) nothing is
        # timed or packed: the device's own kernels, no second copy of the weights
        self.fast_linear = fast_linear if dev.type == "cpu" else False
        # among products in the model's own precision: fp32 for an fp32 model, its bf16 weights for a bf16 one (on
        # CPUs with AMX oneDNN's packed bf16 products stay nearly flat from 1 to 16 rows)
        self.linear_kernels = choose_model_kernels(self.model, self._timing_step) if self.fast_linear is True else {}
        self.packed_linears = (self.linear_kernels.get("replaced", 0) if self.fast_linear is True
                               else pack_linears(self.model) if self.fast_linear == "packed" else 0)
        self.num_layers: int = self.model.config.num_hidden_layers
        self._hooks: list[Any] = []
        self._taps: dict[int, torch.Tensor] | None = None
        self.set_tap_layers(list(tap_layers) if tap_layers is not None else default_tap_layers(self.num_layers, tap_method))

    @property
    def device(self) -> torch.device:
        """Where the weights (and so every tensor the decoder makes for them) live."""
        return next(self.model.parameters()).device

    def _timing_step(self, rows: int) -> None:
        """One forward of ``rows`` tokens, no cache: what :func:`choose_model_kernels` times."""
        ids = torch.zeros(1, rows, dtype=torch.long, device=next(self.model.parameters()).device)
        self.model(input_ids=ids, use_cache=False)

    def _tap_module(self, layer: int) -> nn.Module | None:
        """The module whose input is the output of decoder layer ``layer``: layer ``layer + 1``, or after the last
        layer the final norm; None where the model does not name its layers as Llama-style models do."""
        inner = getattr(self.model, "model", None)
        layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
        if layers is None or norm is None or len(layers) != self.num_layers:
            return None
        return layers[layer + 1] if layer + 1 < self.num_layers else norm

    def set_tap_layers(self, taps: Sequence[int]) -> None:
        """Choose the decoder layers whose outputs are returned as ``tap_states`` (checked against the depth) and hook
        the modules they enter."""
        taps = [int(i) for i in taps]
        bad = [i for i in taps if not 0 <= i < self.num_layers]
        if bad or not taps:
            raise UserError(f"tap_layers {bad or taps} out of range: the target has {self.num_layers} decoder layers (0..{self.num_layers - 1})")
        if getattr(self, "tap_layers", None) == taps and self._hooks:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.tap_layers = taps
        mods = [self._tap_module(i) for i in sorted(set(taps))]
        if all(m is not None for m in mods):
            for i, m in zip(sorted(set(taps)), mods):
                self._hooks.append(m.register_forward_pre_hook(_Grab(self, i), with_kwargs=True))

    def train(self, mode: bool = True) -> "FrozenTarget":  # stays in eval mode whatever Lightning asks
        return super().train(False)

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def identity(self) -> dict:
        """What a draft or a feature cache records to check it is used with the same target."""
        c = self.model.config
        return {"name_or_path": str(self.name_or_path), "architectures": list(c.architectures or [type(self.model).__name__]),
                "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers, "vocab_size": c.vocab_size}

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, return_logits: bool = False,
                cache: Any = None, use_cache: bool = False, position_ids: torch.Tensor | None = None) -> TargetOutput:
        """``cache``: a transformers ``Cache`` extended in place when ``use_cache`` (the decoder's KV cache)."""
        hooked = bool(self._hooks)
        self._taps = {}
        try:
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
                                   output_hidden_states=not hooked, position_ids=position_ids)
            got = self._taps if hooked else {i: out.hidden_states[hf_hidden_index(i)] for i in self.tap_layers}
        finally:
            self._taps = None
        taps = torch.stack([got[i] for i in self.tap_layers], dim=2)  # [B, T, n_taps, d]
        last = out.last_hidden_state  # [B, T, d], after the final norm
        logits = self.model.lm_head(last) if return_logits else None
        return TargetOutput(tap_states=taps, last_state=last, logits=logits, lm_head=self.model.lm_head)


def random_target(name_or_path: str = "random-llama", dtype: str = "bfloat16", tap_layers: Sequence[int] | None = None,
                  device: str = "cpu", **config: Any) -> FrozenTarget:
    """A random-weight Llama of the given shape (``LlamaConfig`` keys), for benchmarks that need no weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    target = FrozenTarget(model=model, tap_layers=tap_layers, dtype=dtype, device=device)
    target.name_or_path = name_or_path
    return target
