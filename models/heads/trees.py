"""Draft trees: the one builder every tree-capable head uses, and the node bookkeeping the decoder verifies.

A tree proposal (:class:`models.heads.drafting.Proposal` with ``parents``) lists nodes in topological order:
node i holds a token, its parent (−1: the pending token, the root) and, when sampling, the distribution q its
siblings were drawn from. The target verifies all nodes in one forward (each node attends to the context and
its ancestors, :func:`tree_mask`) and keeps the longest accepted root-to-node path.

Growth (:func:`grow_tree`, after EAGLE-2's dynamic trees, Li et al. arXiv 2406.16858): level by level, the
``topk`` frontier nodes with the highest cumulative draft probability are expanded, each into its ``topk``
most probable children (greedy) or ``topk`` children drawn *without replacement* from q (sampling;
Gumbel-top-k), for ``depth`` levels. Greedy, as EAGLE-2: the best ``budget`` nodes by cumulative probability of
the whole expansion are kept; growth stops early at a level where ``budget`` nodes already score at least as high
as every frontier node, since no deeper node could then be kept (the same tree, fewer draft forwards).
Sampling: pruning a drawn child because of its own value would bias the candidates away from q, so there every
drawn child is kept and the budget is spent while drawing (how many children a node gets depends only on its
ancestors). That is what the decoder's recursive rejection over siblings (SpecInfer, Miao et al. arXiv
2305.09781; without replacement) needs to keep the target's distribution. ``min_prob`` stops expanding nodes
whose path probability falls below it (adaptive length). A chain is ``topk=1``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from models.heads.drafting import Proposal, Sampler, TreeSpec
from models.heads.vocab import spread


def children(logits: torch.Tensor, n: int, sampler: Sampler,
             vocab: tuple[torch.Tensor, int] | None = None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """logits [V] → (n child tokens in draw order, their draft probabilities [n], q [V] or None).

    Greedy: the n most probable tokens (ties: lower id) under softmax(logits), q None. Sampling: q =
    ``sampler.probs(logits)`` and n tokens drawn from it without replacement (Gumbel-top-k), fewer when q has
    fewer than n tokens with mass. ``vocab`` = (ids [Vd] ascending, V): the logits [Vd] are over a draft
    vocabulary, the tokens are mapped to target ids and q (sampling) is spread over the V target ids."""
    if sampler.greedy:
        p = torch.softmax(logits.float(), -1)
        top = p.topk(min(n, p.numel())).indices
        return (top if vocab is None else vocab[0][top]).tolist(), p[top], None
    q = sampler.probs(logits)
    n = min(n, int((q > 0).sum()))
    g = sampler.generator
    u = torch.rand(q.shape, generator=g, device=g.device if g is not None else q.device).to(q.device).clamp_(1e-20, 1 - 1e-7)
    keys = q.log() - (-u.log()).log()  # log q + Gumbel(0, 1); −inf where q = 0
    top = keys.topk(n).indices
    if vocab is None:
        return top.tolist(), q[top], q
    return vocab[0][top].tolist(), q[top], spread(q, *vocab)


Expand = Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def grow_tree(root_logits: torch.Tensor, expand: Expand, spec: TreeSpec, sampler: Sampler,
              vocab: tuple[torch.Tensor, int] | None = None) -> Proposal:
    """Grow a draft tree (see the module docstring).

    ``root_logits`` [V]: the draft's logits for the first drafted token (over the target vocabulary; −inf where the
    draft cannot propose). ``expand(nodes, tokens, parents)``: the draft's logits [len(nodes), V] for the token
    after each of these node indices, given the tokens [N] and parents [N] (target ids) of the N nodes grown so far
    (the head runs its layer on those paths). One call per level, with the level's nodes in creation order (all one
    depth). ``vocab`` = (ids [Vd], V): the logits are over a draft vocabulary of these ascending target ids instead
    (softmax and top-k over Vd columns, not V; the proposal is in target ids either way)."""
    tokens: list[int] = []
    parents: list[int] = []
    logp: list[float] = []
    qs: list[torch.Tensor | None] = []
    frontier, frontier_logits = [-1], root_logits[None]  # root = the pending token
    root_lp = 0.0
    floor = math.log(spec.min_prob) if spec.min_prob > 0 else -math.inf
    # greedy: grow the full top-k expansion, then keep the best ``budget`` nodes (EAGLE-2's re-ranking); sampling:
    # stop drawing at the budget (pruning a drawn child by its own value would bias the candidates)
    cap = spec.budget if not sampler.greedy else spec.topk + (spec.depth - 1) * spec.topk ** 2
    for level in range(spec.depth):
        score = [root_lp if f < 0 else logp[f] for f in frontier]
        order = sorted(range(len(frontier)), key=lambda i: (-score[i], i))
        new: list[int] = []
        for i in order:
            room = cap - len(tokens)
            if room <= 0:
                break
            toks, probs, q = children(frontier_logits[i], min(spec.topk, room), sampler, vocab)
            for t, pr in zip(toks, probs.tolist()):
                new.append(len(tokens))
                tokens.append(t)
                parents.append(frontier[i])
                logp.append(score[i] + math.log(max(pr, 1e-30)))
                qs.append(q)
        if not new or len(tokens) >= cap or level + 1 == spec.depth:
            break
        # the next level expands the best ``topk`` new nodes (children below min_prob stay leaves); expand() gets
        # them in creation order, and they are expanded best first
        keep = sorted(sorted((n for n in new if logp[n] >= floor), key=lambda n: (-logp[n], n))[: spec.topk])
        if not keep:
            break
        if sampler.greedy:  # a node never scores above its parent, and ties keep the older node: once budget nodes
            best = max(logp[n] for n in keep)  # score at least the best frontier node, no deeper node can make the cut
            if sum(lp >= best for lp in logp) >= spec.budget:
                break
        frontier, frontier_logits = keep, expand(keep, torch.tensor(tokens, dtype=torch.long),
                                                 torch.tensor(parents, dtype=torch.long))
    if len(tokens) > spec.budget:  # greedy re-ranking: a child never scores above its parent, so the best nodes
        keep = sorted(sorted(range(len(tokens)), key=lambda n: (-logp[n], n))[: spec.budget])  # form a tree
        new_index = {old: i for i, old in enumerate(keep)}
        tokens, qs = [tokens[n] for n in keep], [qs[n] for n in keep]
        parents = [-1 if parents[n] < 0 else new_index[parents[n]] for n in keep]
    probs = None if any(q is None for q in qs) or not qs else torch.stack(qs)
    return Proposal(torch.tensor(tokens, dtype=torch.long), probs, torch.tensor(parents, dtype=torch.long))


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [n] (topological order, −1 = root) → depth [n] of each node (children of the root: 1)."""
    depth = []
    for p in parents.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [n] → bool [n, n]: [i, j] when node j is node i or one of its ancestors."""
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_mask(parents: torch.Tensor, past: int) -> torch.Tensor:
    """The verify block ``[pending, node_0..node_{n-1}]`` over a cache of ``past`` tokens → bool [1+n, past+1+n]:
    every row sees the whole cache and the pending token; a node also sees its ancestors and itself."""
    n = parents.numel()
    block = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
    block[:, 0] = True
    block[1:, 1:] = ancestors(parents)
    return torch.cat([torch.ones(1 + n, past, dtype=torch.bool), block], dim=1)


def path_to(node: int, parents: torch.Tensor) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root, −1)."""
    out, p = [], node
    while p >= 0:
        out.append(p)
        p = int(parents[p])
    return out[::-1]


def chain_parents(n: int) -> torch.Tensor:
    """The parents of a chain of n nodes: [−1, 0, 1, ..., n−2]."""
    return torch.arange(n, dtype=torch.long) - 1
