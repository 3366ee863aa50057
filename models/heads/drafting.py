"""The drafting contract: what the speculative decoder (:mod:`eval.decoding.decoder`) asks of every drafter.

A drafter (a trained head, the n-gram lookup, a small draft model) implements :class:`Drafter`:
``start`` after the target's prefill (with the prompt's target features), ``propose`` up to k tokens after
the pending token, ``commit`` the tokens the target accepted (with their target features). ``commit`` may follow
``commit`` with no ``propose`` between (a round another drafter drafted): the drafter keeps both. Its
:class:`Proposal` carries the drafted tokens and, when sampling, the distributions q they were drawn
from; the decoder's rejection sampling is lossless only if that q is exactly the one each token was drawn
from. :func:`draw` is the one place that turns draft logits into (token, q) under the decoder's
:class:`Sampler` (temperature, top-p), so every drafter honours the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from data.errors import UserError

if TYPE_CHECKING:
    from models.target import TargetOutput


@dataclass
class Sampler:
    """Token choice of the decoder: greedy when temperature == 0, else temperature + optional top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] → the sampling distribution [..., V] (fp32)."""
        p = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sp, idx = p.sort(dim=-1, descending=True)
            keep = sp.cumsum(-1) - sp < self.top_p  # smallest prefix with mass >= top_p
            sp = sp * keep
            p = torch.zeros_like(p).scatter(-1, idx, sp)
            p = p / p.sum(-1, keepdim=True)
        return p

    def sample(self, p: torch.Tensor) -> int:
        """One token from the distribution p [V] (:func:`sample_rows`)."""
        return int(sample_rows(p.view(1, -1), self.generator))


def sample_rows(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from each row of p [N, V] (non-negative, not necessarily normalised) → [N] long, by the inverse CDF:
    one uniform draw per row against the row's cumulative sums (fp64), found by binary search. ``torch.multinomial``
    draws one exponential per vocabulary entry for a single sample (0.35 ms a token at V = 8,192 and 1.6 ms at 49,152
    on a 2-core CPU, against 0.07 and 0.18 ms here; 2026-12-02), in plain decoding and in every drafted and verified
    token alike.
    A token of probability 0 is never drawn."""
    c = p.double().cumsum(-1)  # [N, V]
    u = torch.rand(c.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=generator.device if generator is not None else c.device).to(c.device)  # [N, 1] in [0, 1)
    tok = torch.searchsorted(c, u.mul_(c[:, -1:]), right=True).view(-1)  # the first index whose cumulative sum exceeds u
    if int(tok.max()) >= p.shape[-1]:  # u rounded up to the total (probability ~1e-16): the last token with mass
        last = p.shape[-1] - 1 - (p.flip(-1) > 0).long().argmax(-1)
        tok = torch.where(tok >= p.shape[-1], last, tok)
    return tok


def draw(logits: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits [..., V] → (tokens [...] long, q [..., V] or None when greedy).

    Greedy: the argmax, no distribution. Sampling: q = ``sampler.probs(logits)`` (temperature, top-p) and
    each token drawn from its own row of q; q is what the proposal must report."""
    if sampler.greedy:
        return logits.argmax(-1), None
    q = sampler.probs(logits)
    tokens = sample_rows(q.reshape(-1, q.shape[-1]), sampler.generator).view(q.shape[:-1])
    return tokens, q


@dataclass
class Proposal:
    """Drafted tokens: a chain (``parents`` None) or a tree (:mod:`models.heads.trees`): nodes in topological
    order, ``parents[i]`` the index of node i's parent (−1: the pending token). When sampling, siblings are drawn
    without replacement from one distribution, in their listed order, and ``probs[i]`` is that distribution.
    ``point`` marks nodes of a tree with ``probs`` that were not drawn from it but chosen deterministically (a lookup's
    branch beside a head's sampled tree, :class:`eval.decoding.lookup.LookupUnion`): verification treats each as a point
    mass, a candidate of its own after its sampled siblings (their rows in ``probs`` are not read)."""

    tokens: torch.Tensor                  # [k] drafted token ids
    probs: torch.Tensor | None = None     # [k, V] the distributions they were drawn from (None: deterministic)
    parents: torch.Tensor | None = None   # [k] tree: parent node index, −1 = the pending token; None: a chain
    usual: bool = True                    # False: not the drafter's usual round (k=auto learns nothing from it)
    point: torch.Tensor | None = None     # [k] bool, with probs and parents: nodes drafted as point masses


class Drafter(Protocol):
    """What the decoder needs from a drafter (a trained head, n-gram lookup, a small LM...). Optional: an attribute
    ``max_draft`` (int or None), the most tokens (tree: levels) it ever drafts, which ``k=auto`` does not exceed."""

    def start(self, prompt_ids: torch.Tensor, feats: TargetOutput) -> None: ...
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal: ...
    def commit(self, tokens: torch.Tensor, feats: TargetOutput) -> None: ...


@dataclass
class TreeSpec:
    """``budget``: drafted nodes at most; ``depth``: levels at most; ``topk``: children per expanded node and
    expanded nodes per level; ``min_prob``: expand only nodes whose path probability under the draft is at least
    this (0: always)."""

    budget: int = 16
    depth: int = 6
    topk: int = 4
    min_prob: float = 0.0

    def __post_init__(self):
        if self.budget < 1 or self.depth < 1 or self.topk < 1:
            raise UserError(f"tree: budget={self.budget}, depth={self.depth}, topk={self.topk}: each must be >= 1")
        if not 0 <= self.min_prob < 1:
            raise UserError(f"tree.min_prob={self.min_prob}: must be in [0, 1)")


class TreeDrafter(Drafter, Protocol):
    """A drafter that can also propose a tree (:func:`models.heads.trees.grow_tree`); ``commit`` still receives the
    accepted path only, so drafters keep no state for nodes the target rejected."""

    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal: ...


def proposal(tokens: list[int], probs: list[torch.Tensor | None]) -> Proposal:
    """A proposal from per-token draws (q rows None when greedy)."""
    qs = [q for q in probs if q is not None]
    return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(qs) if qs else None)
