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


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary [Vd] from its ``d2t`` offsets [Vd]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def choose(logits: torch.Tensor, d2t: torch.Tensor, V: int, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
    """Draft logits [Vd] → (target id, q over the target vocabulary [V] or None when greedy): the draw happens over
    the draft vocabulary, and q is zero outside it."""
    t, q = draw(logits, sampler)
    i = int(t)
    return i + int(d2t[i]), None if q is None else spread(q, draft_ids(d2t), V)


def spread(q: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    """A distribution q [Vd] over the draft vocabulary's target ids ``ids`` [Vd] → [V] over the target vocabulary,
    zero outside it."""
    full = torch.zeros(V, dtype=q.dtype, device=q.device)
    full[ids] = q
    return full
