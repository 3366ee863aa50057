"""One speculative decoder for every drafter (chains and trees; batch size 1).

Loop: prefill the prompt; then each round the drafter proposes up to k tokens after the pending token x,
the target verifies ``[x, d_1..d_k]`` in one forward over its KV cache, the longest acceptable prefix
``d_1..d_n`` is kept, the cache is cropped to it, and the target's own next token (the *bonus*) becomes
the new pending token. Output is exactly the target's:
- greedy (temperature 0): accept while ``d_i == argmax p_i``; the bonus is ``argmax p_n``;
- sampling: accept ``d_i`` with probability ``min(1, p(d_i)/q(d_i))``, on rejection draw from
  ``norm(max(0, p − q))`` (Leviathan et al., arXiv 2211.17192); a drafter that gives no distribution is
  treated as one-hot q, which is the same as sampling y ~ p and accepting iff y == d_i.
Trees (``tree=TreeSpec(...)``, drafters with ``propose_tree``): the target verifies every node in one forward
under a tree attention mask with positions by depth, keeps the longest accepted root-to-node path
(:func:`accept_tree`; sampling: recursive rejection over siblings) and compacts that path's K/V in its cache
(:func:`keep_rows`). A chain is the tree with one child per node, and takes the chain code path.
τ (``tau``) = tokens produced by verification passes / number of passes, bonus included (plain decoding: 1).

The decoder knows drafters only through the drafting contract of :mod:`models.heads.drafting`
(:class:`Drafter`, :class:`Proposal`, :class:`Sampler`, re-exported here): ``start`` (after prefill, with
the prompt's target features), ``propose`` (given the pending token) and ``commit`` (the accepted tokens and
their target features, so the drafter can extend its own context).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from data.errors import UserError
from eval.decoding.kvcache import new_cache
from models.heads.drafting import Drafter, Proposal, Sampler, TreeDrafter
from models.heads.trees import TreeSpec, node_depths, tree_mask
from models.target import TargetOutput, synchronize

__all__ = ["Drafter", "GenStats", "NoDrafter", "Proposal", "Sampler", "SpeculativeDecoder", "TreeDrafter", "TreeSpec",
           "accept_greedy", "accept_sampling", "accept_tree", "crop", "keep_rows", "target_rows"]


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
    drafted: int = 0                      # drafted tokens (tree nodes) sent to verification
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


def accept_tree(draft: torch.Tensor, parents: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
                sampler: Sampler, point: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Walk a verified tree from the root. draft, parents [n]; q [n, V] or None; logits [1+n, V] (row 0: the
    pending token, row 1+i: node i); ``point`` [n] bool or None: nodes that are point masses although q is given
    → (accepted node indices root-down, next token).

    Greedy: follow the child whose token is the target's argmax. Sampling: recursive rejection over the siblings
    in their drawn order (SpecInfer; without replacement): sibling c is accepted with probability
    min(1, p(d_c)/q'(d_c)), where q' is q with the earlier rejected siblings removed and renormalised; on
    rejection p becomes norm(max(0, p − q')). A point-mass sibling (q None, or ``point``) is a candidate drawn
    from one-hot q of its own, independent of the others (SpecInfer's several draft models): accepted with
    probability p(d_c), on rejection p loses d_c; the sampled siblings' q' is left as it was. Nobody accepted: the
    next token is drawn from what is left of p. With one child per node this is :func:`accept_sampling`, draw for
    draw."""
    kids: dict[int, list[int]] = {}
    points = point.tolist() if point is not None else None
    for i, par in enumerate(parents.tolist()):
        kids.setdefault(par, []).append(i)
    path: list[int] = []
    cur = -1
    g = sampler.generator
    while True:
        row = logits[cur + 1]
        cand = kids.get(cur, [])
        if sampler.greedy:
            y = int(row.argmax())
            hit = next((c for c in cand if int(draft[c]) == y), None)
            if hit is None:
                return path, y
        else:
            p = sampler.probs(row)
            hit, qs = None, None
            for c in cand:
                d = int(draft[c])
                one_hot = q is None or (points is not None and points[c])
                if one_hot:  # deterministic candidate: one-hot q
                    qc = torch.zeros_like(p)
                    qc[d] = 1.0
                else:
                    if qs is None:
                        qs = q[c]
                    qc = qs
                if float(torch.rand((), generator=g)) < min(1.0, float(p[d]) / max(float(qc[d]), 1e-30)):
                    hit = c
                    break
                residual = (p - qc).clamp_min(0)
                s = float(residual.sum())
                if s > 0:
                    p = residual / s
                if not one_hot:  # the next sampled sibling was drawn from q without this token
                    qs = qc.clone()
                    qs[d] = 0
                    qs = qs / qs.sum().clamp_min(1e-30)
            if hit is None:
                return path, sampler.sample(p)
        path.append(hit)
        cur = hit


class SpeculativeDecoder:
    """Batch-size-1 speculative decoding of a frozen target with any :class:`Drafter`."""

    def __init__(self, target: Any, eos_token_ids: list[int] | int | None = None):
        self.target = target
        eos = eos_token_ids if eos_token_ids is not None else target.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, drafter: Drafter, k: "int | Any" = 5, max_new_tokens: int = 128,
                 sampler: Sampler | None = None, record_top: int = 0, tree: TreeSpec | None = None) -> tuple[list[int], GenStats]:
        """prompt_ids [T] or [1, T] → (new token ids, stats). Stops at EOS (included) or exactly max_new_tokens.

        ``tree``: drafters with ``propose_tree`` (:class:`TreeDrafter`) propose trees of this shape, others
        chains of ``k``. ``k`` may be an :class:`eval.decoding.autok.AutoK` (``k=auto``), which picks each round's length.

        ``record_top`` > 0 (greedy only): keep, for every new token, the target's top ``record_top`` ids and
        logits at the position that chose it (``stats.top``), so a divergence can be told from a near-tie."""
        auto = hasattr(k, "choose")  # eval.decoding.autok.AutoK: the draft length is chosen every round
        if not auto and k < 0:
            raise UserError(f"draft length k={k}: must be >= 1 (0 for plain decoding)")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        sampler = sampler or Sampler()
        dev = getattr(self.target, "device", prompt_ids.device)  # every tensor made here lives with the target's weights
        ids = prompt_ids.view(1, -1).to(dev)
        stats = GenStats()
        synchronize(dev)  # CUDA runs asynchronously: each timer reads the work done, not the work queued
        t0 = time.perf_counter()
        cache = new_cache()  # K/V in buffers grown by doubling (eval/kvcache.py), not concatenated every step
        out = self.target(ids, cache=cache, use_cache=True)
        logits = self.target.model.lm_head(out.last_state[:, -1:])[0]  # [1, V]
        first = int(logits[0].argmax()) if sampler.greedy else sampler.sample(sampler.probs(logits[0]))
        drafter.start(ids, out)
        synchronize(dev)
        stats.t_prefill = time.perf_counter() - t0
        if record_top and sampler.greedy:
            _record_top(stats, logits, 1, record_top)
        new = [first]
        cached = ids.shape[1]  # tokens in the target cache
        longest = getattr(drafter, "max_draft", None) or max_new_tokens  # k=auto chooses no longer draft than the drafter makes
        while len(new) < max_new_tokens and new[-1] not in self.eos:
            budget = max_new_tokens - len(new)
            kk = k.choose(min(budget - 1, longest)) if auto else min(k, budget - 1)  # the pass also yields a bonus token
            t1 = time.perf_counter()
            if kk <= 0:
                prop = Proposal(torch.empty(0, dtype=torch.long))
            elif tree is not None and hasattr(drafter, "propose_tree"):  # k=auto with a tree: kk is its depth
                prop = drafter.propose_tree(new[-1], replace(tree, depth=min(tree.depth, budget - 1, kk if auto else tree.depth)), sampler)
            else:
                prop = drafter.propose(new[-1], kk, sampler)
            is_tree = prop.parents is not None
            draft = (prop.tokens if is_tree else prop.tokens[:kk]).to(dev, torch.long)
            synchronize(dev)
            t2 = time.perf_counter()
            block = torch.cat([torch.tensor([new[-1]], device=dev), draft]).view(1, -1)  # [1, 1+n]
            if is_tree:  # one forward over the whole tree: tree attention mask, positions by depth
                depth = node_depths(prop.parents).to(dev)
                pos = cached + torch.cat([depth.new_zeros(1), depth])[None]  # [1, 1+n]
                mask = tree_mask(prop.parents, cached).to(dev)
                bias = torch.zeros(mask.shape, dtype=getattr(self.target.model, "dtype", torch.float32),
                                   device=dev).masked_fill_(~mask, float("-inf"))
                vout = self.target(block, attention_mask=bias[None, None], position_ids=pos, cache=cache, use_cache=True)
            else:
                vout = self.target(block, cache=cache, use_cache=True)
            vlogits = self.target.model.lm_head(vout.last_state)[0]  # [1+n, V]
            synchronize(dev)
            t3 = time.perf_counter()
            if is_tree:
                path, nxt = accept_tree(draft, prop.parents, prop.probs, vlogits, sampler, prop.point)
                keep = [0] + [1 + i for i in path]  # block rows of the accepted path
                keep_rows(cache, cached, keep)
                n, reached = len(path), int(depth.max()) if draft.numel() else 0
            else:
                if sampler.greedy:
                    n, nxt = accept_greedy(draft, vlogits)
                else:
                    n, nxt = accept_sampling(draft, None if prop.probs is None else prop.probs[:kk], vlogits, sampler)
                keep, reached = list(range(1 + n)), draft.numel()
                crop(cache, cached + 1 + n)
            cached += 1 + n
            stats.drafted += draft.numel()
            accepted = block[0, keep[1:]].tolist()
            stop = next((i for i, t in enumerate(accepted) if t in self.eos), None)  # EOS inside the accepted block
            if stop is not None:
                accepted = accepted[: stop + 1]
            stats.add_round(reached, n)
            # a drafter may propose past the budget (a lookup branch beside a head's tree): never emit past it
            produced = (accepted + ([nxt] if stop is None else []))[: max_new_tokens - len(new)]
            stats.verified_tokens += len(produced)
            if record_top and sampler.greedy:
                _record_top(stats, vlogits[keep], len(produced), record_top)
            new += produced
            t_draft_before = stats.t_draft
            stats.t_draft += t2 - t1
            stats.t_verify += t3 - t2
            if stop is not None or nxt in self.eos:
                break
            t4 = time.perf_counter()
            drafter.commit(block[0, keep], target_rows(vout, keep))
            synchronize(dev)
            stats.t_draft += time.perf_counter() - t4
            if auto and prop.usual:
                k.update(reached, n, stats.t_draft - t_draft_before, reached if is_tree else draft.numel(), draft.numel(),
                         timed=stats.passes > 1, verify_s=t3 - t2)  # the first round also caught the drafter up on the prompt
        stats.new_tokens = len(new)
        synchronize(dev)
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


def keep_rows(cache: Any, start: int, rows: list[int]) -> None:
    """After verifying a block at cache positions ``start..``: keep the block's ``rows`` (the accepted path) at
    ``start, start+1, ...`` and drop the rest. A chain's path is a prefix, so that is a crop; a tree's path is
    compacted in place (one gather per layer)."""
    if rows != list(range(len(rows))):
        sel = torch.tensor(rows, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[..., start: start + len(rows), :] = layer.keys[..., sel, :]
            layer.values[..., start: start + len(rows), :] = layer.values[..., sel, :]
    crop(cache, start + len(rows))


def target_rows(out: TargetOutput, rows: list[int]) -> TargetOutput:
    """The given positions of a target output (the accepted path of a verify block)."""
    if rows == list(range(len(rows))):
        return TargetOutput(tap_states=out.tap_states[:, : len(rows)], last_state=out.last_state[:, : len(rows)])
    idx = torch.tensor(rows, device=out.last_state.device)
    return TargetOutput(tap_states=out.tap_states[:, idx], last_state=out.last_state[:, idx])
