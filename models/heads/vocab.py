"""A draft vocabulary: the ``size`` most frequent target tokens a head drafts from.

EAGLE-3 trains its own output head over such a vocabulary (Li et al., arXiv 2503.01840); MTP may restrict its frozen
copy of the target's head to one at decoding time. Stored as SGLang/speculators do: ``d2t`` [Vd] offsets
(``target_id = draft_id + d2t[draft_id]``) and ``t2d`` bool [V] over the target vocabulary. The helpers map draft
logits back to target ids and distributions, so the decoder only ever sees the target vocabulary.
"""
from __future__ import annotations

import torch

from models.heads.drafting import Sampler, draw


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent target ids (ties: lower id) → ``d2t`` [size] offsets and ``t2d`` bool [V]."""
    V = token_counts.numel()
    size = min(size, V)
    order = torch.argsort(-token_counts.double(), stable=True)  # ties: lower id first
    ids = torch.sort(order[:size]).values
    d2t = ids - torch.arange(size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def vocab_coverage(token_counts: torch.Tensor, ids: torch.Tensor) -> str:
    """One line: how much of the training split's loss tokens (counts [V]) the draft vocabulary ``ids`` [Vd] holds."""
    total = float(token_counts.sum())
    share = float(token_counts[ids.to(token_counts.device)].sum()) / total if total else 0.0
    return (f"draft vocabulary: {ids.numel():,} of {token_counts.numel():,} tokens, {100 * share:.2f}% of the training "
            f"split's {int(total):,} loss tokens")


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary [Vd] from its ``d2t`` offsets [Vd]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def choose(logits: torch.Tensor, d2t: torch.Tensor, V: int, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
    """Draft logits [Vd] → (target id, q over the target vocabulary [V] or None when greedy): the draw happens over
    the draft vocabulary, and q is zero outside it."""
    t, q = draw(logits, sampler)
    i = int(t)
    return i + int(d2t[i]), None if q is None else spread(q, draft_ids(d2t), V)


def spread(q: torch.Tensor, ids: torch.Tensor, V: int, fill: float = 0.0) -> torch.Tensor:
    """Rows q [..., Vd] over the draft vocabulary's target ids ``ids`` [Vd] → [..., V] over the target vocabulary,
    ``fill`` outside it (0 for distributions, −inf for logits)."""
    full = torch.full((*q.shape[:-1], V), fill, dtype=q.dtype, device=q.device)
    full[..., ids] = q
    return full


def _reselect_rows(head: "FrozenRows", _incompatible: object) -> None:
    """After ``load_state_dict``: the loaded vocabulary picks the draft rows again (a module-level hook: picklable)."""
    head._select_rows()


class FrozenRows:
    """A draft vocabulary over the target's own frozen head (MTP, DFlash, DSpark): ``draft_head`` holds ``lm_head``'s
    rows of the draft vocabulary, so the logits on those rows are exactly the full head's and a drafted token reads Vd
    rows instead of V. The host module has ``lm_head``; it calls :meth:`init_draft_rows` once built."""

    draft_vocab_size: int | None

    def init_draft_rows(self, size: int | None, field: str = "draft.draft_vocab_size") -> None:
        """``size`` tokens (None, or at least the vocabulary: the full head). Identity-like until data is seen."""
        from data.errors import UserError
        from models.layers import frozen_linear

        V = self.lm_head.out_features
        if size is not None and size < 1:
            raise UserError(f"{field}={size}: a token count >= 1, or null for the full vocabulary")
        self.draft_vocab_size = None if size is None or size >= V else int(size)
        if self.draft_vocab_size:
            d2t, t2d = build_draft_vocab(torch.ones(V), self.draft_vocab_size)
            self.register_buffer("d2t", d2t)
            self.register_buffer("t2d", t2d)
            self.register_buffer("t2i", torch.full((V,), -1), persistent=False)  # target id → draft index, −1 outside
            self.draft_head = frozen_linear(self.lm_head.weight[: self.draft_vocab_size])  # d → Vd
            self._select_rows()
            self.register_load_state_dict_post_hook(_reselect_rows)

    def prepare_from_data(self, token_counts: torch.Tensor) -> None:
        if self.draft_vocab_size:
            d2t, t2d = build_draft_vocab(token_counts, self.draft_vocab_size)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            self._select_rows()

    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary [Vd] (only with ``draft_vocab_size``)."""
        return draft_ids(self.d2t)

    @torch.no_grad()
    def _select_rows(self) -> None:
        """draft_head ← the frozen head's rows of the draft vocabulary (after the vocabulary was chosen or loaded)."""
        ids = self.draft_ids()
        self.draft_head.weight.copy_(self.lm_head.weight[ids])
        self.t2i.fill_(-1)
        self.t2i[ids] = torch.arange(ids.numel(), device=ids.device)
        self._rows_of = self.lm_head.weight._version  # reselect_if_stale() selects again if the head changed in place

    def reselect_if_stale(self) -> None:
        """At the start of decoding: the rows again if ``lm_head`` was written in place since they were taken."""
        if self.draft_vocab_size and self.lm_head.weight._version != self._rows_of:
            self._select_rows()

    def vocab(self) -> tuple[torch.Tensor, int] | None:
        """(target ids [Vd], V) of the draft logits' columns where there is a draft vocabulary, else None."""
        return (self.draft_ids(), self.lm_head.out_features) if self.draft_vocab_size else None

    def rows_logits(self, h: torch.Tensor) -> torch.Tensor:
        """States [..., d] → logits [..., Vd] through the draft rows, or [..., V] without a draft vocabulary."""
        return self.draft_head(h) if self.draft_vocab_size else self.lm_head(h)

    def draw_rows(self, logits: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`draw` on logits [k, Vd] (or [k, V]) → target ids [k] and q [k, V] over the target vocabulary."""
        tokens, q = draw(logits, sampler)
        if not self.draft_vocab_size:
            return tokens, q
        ids = self.draft_ids()
        return ids[tokens], None if q is None else spread(q, ids, self.lm_head.out_features)

    def draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids [M] → (their columns of the draft logits [M], bool [M]: inside the draft vocabulary)."""
        if not self.draft_vocab_size:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        col = self.t2i[labels]
        return col.clamp(min=0), col >= 0

    def column_ids(self, cols: torch.Tensor) -> torch.Tensor:
        """Columns of the draft logits → target ids."""
        return self.draft_ids()[cols] if self.draft_vocab_size else cols

    def on_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] → −inf outside the draft vocabulary (what decoding can draft)."""
        return logits.masked_fill(~self.t2d, float("-inf")) if self.draft_vocab_size else logits
