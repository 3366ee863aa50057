"""The one draft-head interface every family implements, and the self-describing export format.

Training: ``training_loss(batch, feats)`` returns a :class:`HeadOutput` (loss plus per-step accuracy
counts, step j = the j-th drafted token). The Lightning module owns optimisation, logging and
checkpoints and never asks which head it holds. A head declares which target features it needs
(``tap_method`` for the default tap layers, ``reads_taps`` whether it reads them at all, ``needs_teacher_logits``
whether its loss reads the target's logits, which it asks of :class:`models.target.TargetOutput`: ``all_logits`` or
``logits_at`` the rows it scores; the memory planner counts them).

Export: a directory with ``config.json`` (head class, constructor arguments, target identity, tap
layers), ``model.safetensors`` and the resolved training config; :func:`models.formats.load_draft` rebuilds
the head on a target without Lightning. Serving formats (:mod:`models.formats`) read a head through
``decoder_layer`` and ``serving_dims``, which each servable family declares.

Decoding: every head is also a :class:`models.heads.drafting.Drafter` (``start``, ``propose``, ``commit``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from data.errors import UserError, atomic_dir, read_json

if TYPE_CHECKING:
    from models.heads.trees import TreeSpec

FORMAT = "draftsmith-draft/1"


@dataclass
class HeadOutput:
    loss: torch.Tensor
    correct: torch.Tensor            # [K] positions where step j's top-1 equals the target's top-1
    total: torch.Tensor              # [K] positions scored at step j
    accepted: torch.Tensor | None = None  # [K] Σ over those positions of Σ_v min(p, q): T=1 acceptance against the target (soft-target heads)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class DraftHead(nn.Module):
    """Base class. Subclasses set ``family`` and implement ``training_loss``; constructor arguments are
    recorded (``self.init_args``) so that export and load need no extra code per head."""

    family: ClassVar[str] = "base"
    tap_method: ClassVar[str] = "eagle3"
    reads_taps: ClassVar[bool] = True  # False: only the final-norm feature, so a cache written with any taps fits
    needs_teacher_logits: ClassVar[bool] = False
    decode_only_state: ClassVar[tuple[str, ...]] = ()  # state that only changes how we draft: serving formats may drop it
    decode_settings: ClassVar[tuple[str, ...]] = ()  # init arguments that only change how we draft (eval.decoding.drafters.load_head's ``decode``)

    @property
    def vocab_state(self) -> tuple[str, ...]:
        """A draft vocabulary that costs no training: its ``d2t``/``t2d`` and output rows are the target's own frozen
        rows. ``init_from=`` takes it from the new run (its size, chosen on its data) where the export lacks it or
        holds another size, so a trained head can draft from fewer rows unchanged. Default: the decode-only state."""
        return self.decode_only_state

    def __init__(self, target: Any, **init_args: Any):
        super().__init__()
        self.init_args = init_args
        self.target_identity = target.identity()
        self.tap_layers = list(target.tap_layers)

    # -- training -------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        raise NotImplementedError

    def prepare_from_data(self, token_counts: torch.Tensor) -> None:
        """Called once before training with the loss-masked token counts [V] of the training split."""

    @property
    def num_steps(self) -> int:
        """How many tokens the head drafts per round (the K of the per-step accuracies)."""
        raise NotImplementedError

    @property
    def max_draft(self) -> int | None:
        """The most tokens ``propose`` drafts whatever k is asked (a tree: the most levels); None: no limit.
        ``k=auto`` chooses no more than this."""
        return None

    def within_reach(self, tree: TreeSpec) -> TreeSpec:
        """``tree`` no deeper than :attr:`max_draft` (what ``propose_tree`` grows)."""
        cap = self.max_draft
        return tree if cap is None or tree.depth <= cap else replace(tree, depth=cap)

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        """What decoding must reproduce: the training forward's logits [steps, V] (target vocabulary; −inf
        where the head cannot draft) for tokens ``at+2 .. at+1+steps`` of ``ids`` [1, T], teacher-forced
        on ``ids`` itself. Positions ``<= at`` are the committed context (``feats`` from one target forward
        over ``ids``), ``at+1`` the pending token and the rest the drafts. Used by the decode-equals-train
        test of every head (tests/test_decode_equals_train.py)."""
        raise NotImplementedError

    # -- serving formats (models.formats) -------------------------------------------------------------
    def decoder_layer(self) -> nn.Module:
        """The (first) decoder layer whose sizes an engine config names (``self_attn``, ``mlp``)."""
        raise NotImplementedError(f"{self.family}: no serving format holds this family")

    def serving_dims(self) -> dict:
        """Architecture numbers an engine config names beyond the decoder layer's (hidden size, vocabulary, ...)."""
        return {}

    def check_target(self, target: Any) -> None:
        """Raise a UserError when ``target`` is not the one this head was built for."""
        mine, theirs = self.target_identity, target.identity()
        for k in ("hidden_size", "vocab_size", "num_hidden_layers"):
            if mine.get(k) != theirs.get(k):
                raise UserError(f"draft was built for target {mine.get('name_or_path')!r} ({k}={mine.get(k)}), "
                                f"but the target is {theirs.get('name_or_path')!r} ({k}={theirs.get(k)})")

    # -- export ---------------------------------------------------------------------------------
    def target_copies(self) -> list[str]:
        """State-dict keys that are frozen copies of the target's own tensors (``models.layers.frozen_embedding`` /
        ``frozen_linear``): the constructor rebuilds them from the target, so our exports leave them out (for
        SmolLM2 the embedding alone is 28M parameters, three times the trained head)."""
        return [f"{name}.{k}" if name else k for name, m in self.named_modules() if getattr(m, "from_target", False)
                for k in m.state_dict()]

    def export(self, out_dir: str | Path, train_config: dict | None = None, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + model.safetensors (+ train_config.json) atomically; ``dtype`` casts floating
        tensors (bf16 halves a shipped draft; loading casts back to the head's own dtype)."""
        from safetensors.torch import save_file

        skip = set(self.target_copies())
        cfg = {"format": FORMAT, "family": self.family, "class": f"{type(self).__module__}.{type(self).__qualname__}",
               "init_args": self.init_args, "target": self.target_identity, "tap_layers": self.tap_layers,
               "num_steps": self.num_steps, "from_target": sorted(skip)}
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items() if k not in skip}
        with atomic_dir(out_dir) as tmp:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            if train_config is not None:
                (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2, default=str) + "\n")
        return Path(out_dir)


def read_draft_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.exists():
        raise UserError(f"{path}: not an exported draft (no config.json); export one with `python -m train ...`")
    return read_json(p, FORMAT)
