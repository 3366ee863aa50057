"""One speculative decoder for every drafter (chain drafts; batch size 1).

Loop: prefill the prompt; then each round the drafter proposes up to k tokens after the pending token x,
the target verifies ``[x, d_1..d_k]`` in one forward over its KV cache, the longest acceptable prefix
``d_1..d_n`` is kept, the cache is cropped to it, and the target's own next token (the *bonus*) becomes
the new pending token. Output is exactly the target's:
- greedy (temperature 0): accept while ``d_i == argmax p_i``; the bonus is ``argmax p_n``;
- sampling: accept ``d_i`` with probability ``min(1, p(d_i)/q(d_i))``, on rejection draw from
  ``norm(max(0, p − q))`` (Leviathan et al., arXiv 2211.17192); a drafter that gives no distribution is
  treated as one-hot q, which is the same as sampling y ~ p and accepting iff y == d_i.
τ (``tau``) = tokens produced by verification passes / number of passes, bonus included (plain decoding: 1).

The decoder knows drafters only through the drafting contract of :mod:`models.heads.drafting`
(:class:`Drafter`, :class:`Proposal`, :class:`Sampler`, re-exported here): ``start`` (after prefill, with
the prompt's target features), ``propose`` (given the pending token) and ``commit`` (the accepted tokens and
their target features, so the drafter can extend its own context).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from data.errors import UserError
from models.heads.drafting import Drafter, Proposal, Sampler
from models.target import TargetOutput

__all__ = ["Drafter", "GenStats", "NoDrafter", "Proposal", "Sampler", "SpeculativeDecoder", "accept_greedy",
           "accept_sampling", "crop"]


class NoDrafter:
    """Plain decoding through the same loop: proposes nothing (the speed-up reference)."""

    def start(self, prompt_ids, feats) -> None:
        pass

    def propose(self, pending, k, sampler) -> Proposal:
        return Proposal(tokens=torch.empty(0, dtype=torch.long))

    def commit(self, tokens, feats) -> None:
        pass


@dataclass
class GenStats:
    new_tokens: int = 0
    passes: int = 0                       # target verification passes (prefill excluded)
    verified_tokens: int = 0              # tokens produced by verification passes
    accepted_hist: list[int] = field(default_factory=list)   # accepted drafted tokens per pass
    proposed_at: list[int] = field(default_factory=list)     # [i]: passes in which position i+1 was proposed and reached
    accepted_at: list[int] = field(default_factory=list)     # [i]: ... and accepted
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_prefill: float = 0.0
    t_total: float = 0.0
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per new token: the target's top ids/logits (record_top)

    def add_round(self, proposed: int, accepted: int) -> None:
        self.passes += 1
        self.accepted_hist.append(accepted)
        for i in range(proposed):
            while len(self.proposed_at) <= i:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            if i <= accepted:  # position i+1 was reached (all before it accepted)
                self.proposed_at[i] += 1
                self.accepted_at[i] += int(i < accepted)
            else:
                break


def accept_greedy(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """draft [k], logits [k+1, V] → (n accepted, bonus token)."""
    top = logits.argmax(-1)  # [k+1]
    k = draft.numel()
    n = int((top[:k] == draft).long().cumprod(0).sum()) if k else 0
    return n, int(top[n])


def accept_sampling(draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampler: Sampler) -> tuple[int, int]:
    """Exact rejection sampling. draft [k], q [k, V] or None (one-hot), logits [k+1, V] → (n accepted, next token)."""
    p = sampler.probs(logits)  # [k+1, V]
    g = sampler.generator
    for i in range(draft.numel()):
        d = int(draft[i])
        if q is None:
            y = sampler.sample(p[i])
            if y == d:
                continue
            return i, y
        ratio = float(p[i, d]) / max(float(q[i, d]), 1e-30)
        if float(torch.rand((), generator=g)) < min(1.0, ratio):
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        s = float(residual.sum())
        return i, sampler.sample(residual / s) if s > 0 else sampler.sample(p[i])
    return draft.numel(), sampler.sample(p[-1])


class SpeculativeDecoder:
    """Batch-size-1 speculative decoding of a frozen target with any :class:`Drafter`."""

    def __init__(self, target: Any, eos_token_ids: list[int] | int | None = None):
        self.target = target
        eos = eos_token_ids if eos_token_ids is not None else target.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, drafter: Drafter, k: int = 5, max_new_tokens: int = 128,
                 sampler: Sampler | None = None, record_top: int = 0) -> tuple[list[int], GenStats]:
        """prompt_ids [T] or [1, T] → (new token ids, stats). Stops at EOS (included) or exactly max_new_tokens.

        ``record_top`` > 0 (greedy only): keep, for every new token, the target's top ``record_top`` ids and
        logits at the position that chose it (``stats.top``), so a divergence can be told from a near-tie."""
        from transformers import DynamicCache

        if k < 0:
            raise UserError(f"draft length k={k}: must be >= 1 (0 for plain decoding)")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        sampler = sampler or Sampler()
        ids = prompt_ids.view(1, -1)
        stats = GenStats()
        t0 = time.perf_counter()
        cache = DynamicCache()
        out = self.target(ids, cache=cache, use_cache=True)
        logits = self.target.model.lm_head(out.last_state[:, -1:])[0]  # [1, V]
        first = int(logits[0].argmax()) if sampler.greedy else sampler.sample(sampler.probs(logits[0]))
        drafter.start(ids, out)
        stats.t_prefill = time.perf_counter() - t0
        if record_top and sampler.greedy:
            _record_top(stats, logits, 1, record_top)
        new = [first]
        cached = ids.shape[1]  # tokens in the target cache
        while len(new) < max_new_tokens and new[-1] not in self.eos:
            budget = max_new_tokens - len(new)
            kk = min(k, budget - 1)  # the pass also yields a bonus token
            t1 = time.perf_counter()
            prop = drafter.propose(new[-1], kk, sampler) if kk > 0 else Proposal(torch.empty(0, dtype=torch.long))
            draft = prop.tokens[:kk].to(torch.long)
            t2 = time.perf_counter()
            block = torch.cat([torch.tensor([new[-1]]), draft]).view(1, -1)  # [1, 1+k]
            vout = self.target(block, cache=cache, use_cache=True)
            vlogits = self.target.model.lm_head(vout.last_state)[0]  # [1+k, V]
            t3 = time.perf_counter()
            if sampler.greedy:
                n, nxt = accept_greedy(draft, vlogits)
            else:
                n, nxt = accept_sampling(draft, None if prop.probs is None else prop.probs[:kk], vlogits, sampler)
            cached += 1 + n
            crop(cache, cached)
            accepted = draft[:n].tolist()
            stop = next((i for i, t in enumerate(accepted) if t in self.eos), None)  # EOS inside the accepted block
            if stop is not None:
                accepted = accepted[: stop + 1]
            stats.add_round(draft.numel(), n)
            produced = accepted + ([nxt] if stop is None else [])
            stats.verified_tokens += len(produced)
            if record_top and sampler.greedy:
                _record_top(stats, vlogits, len(produced), record_top)
            new += produced
            stats.t_draft += t2 - t1
            stats.t_verify += t3 - t2
            if stop is not None or nxt in self.eos:
                break
            t4 = time.perf_counter()
            drafter.commit(block[0, : 1 + n], _slice(vout, 1 + n))
            stats.t_draft += time.perf_counter() - t4
        stats.new_tokens = len(new)
        stats.t_total = time.perf_counter() - t0
        return new, stats


def _record_top(stats: GenStats, logits: torch.Tensor, n: int, top: int) -> None:
    """Append the top ``top`` (ids, logits) of the first ``n`` rows of ``logits`` [>=n, V] to ``stats.top``."""
    vals, idx = logits[:n].float().topk(top, dim=-1)  # [n, top]
    stats.top.extend(zip(idx.tolist(), vals.tolist()))


def crop(cache: Any, length: int) -> None:
    """Crop a transformers cache to ``length`` tokens (transformers 5 takes a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _slice(out: TargetOutput, n: int) -> TargetOutput:
    """The first n positions of a target output (the accepted part of a verify block)."""
    return TargetOutput(tap_states=out.tap_states[:, :n], last_state=out.last_state[:, :n])
