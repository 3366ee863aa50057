"""``grow_tree`` for heads whose next level depends on the drafted tokens (EAGLE-3, MTP).

:func:`models.heads.trees.grow_tree` hands ``expand`` only the node indices of a level; an autoregressive head also
needs those nodes' tokens and parents (its next forward reads them). :func:`grow_on_paths` supplies them without a
second copy of the growth rule: before each expansion it replays ``grow_tree`` up to that level on the logits
already returned, from the same random state, so the replay grows exactly the nodes the real call grew. The
replay runs no draft forward, only grow_tree's own softmax/top-k per node (O(depth²·topk) rows of [V] per
proposal). Should ``grow_tree`` ever pass the tokens and parents to ``expand``, this module can go.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from models.heads.drafting import Proposal, Sampler
from models.heads.trees import TreeSpec, grow_tree

# expand(nodes, tokens [n], parents [n]) → logits [len(nodes), V]; tokens/parents: every node grown so far
PathExpand = Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def grow_on_paths(root_logits: torch.Tensor, expand: PathExpand, spec: TreeSpec, sampler: Sampler) -> Proposal:
    """:func:`grow_tree`, with ``expand`` also given the tokens and parents of the tree grown so far."""
    # grow_tree draws with sampler.generator (None: torch's default CPU generator); replays start from a copy
    gen = sampler.generator if sampler.generator is not None else torch.default_generator
    start = None if sampler.greedy else gen.get_state()
    levels: list[torch.Tensor] = []  # what expand returned, level by level

    def known(nodes: list[int]) -> torch.Tensor:
        replay = sampler if start is None else replace(sampler, generator=torch.Generator().set_state(start))
        given = iter(levels)
        grown = grow_tree(root_logits, lambda _: next(given), replace(spec, depth=len(levels) + 1), replay)
        assert grown.tokens.numel() > max(nodes), "grow_tree replay diverged"
        out = expand(nodes, grown.tokens, grown.parents)
        levels.append(out)
        return out

    return grow_tree(root_logits, known, spec, sampler)
