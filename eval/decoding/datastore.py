"""Retrieval drafting: propose what followed the current suffix in a datastore of the target's own answers.

REST (He et al., "REST: Retrieval-Based Speculative Decoding", arXiv 2311.08252) drafts from a datastore of text
instead of a model; SuffixDecoding (Oliaro et al., arXiv 2411.04975) builds the datastore from the model's own
earlier outputs and drafts a tree ranked by how often each continuation followed. Prompt lookup
(:class:`eval.decoding.lookup.NGramDrafter`) is the special case whose datastore is the current text alone: on a toy target
that loops it is hard to beat, on a real model it matches little (SmolLM2: τ about 1.3), while the same model's
answers to other prompts repeat its phrasing ("Here's a ...", "I'm sorry, but ...") across prompts.

    python -m eval.datastore target=smollm2 sources=[runs/regen-smollm2d/greedy] out=runs/smollm2-datastore
    python -m eval target=smollm2 "+drafters.store={_target_: eval.decoding.datastore.DatastoreDrafter, path: runs/smollm2-datastore}"

A datastore is a directory: ``tokens.safetensors`` (the assistant turns of the source conversations, tokenised with
the target's chat template exactly as :func:`data.chat.tokenize_conversation` masks them for training, end-of-turn
token included, joined with −1 between answers; int32) and ``datastore.json`` (the target's name and vocabulary
size, the sources, counts). Its sources must not hold answers to the prompts it is evaluated on.

Drafting (:class:`DatastoreDrafter`): for n from ``max_ngram`` down to ``min_ngram``, the last n tokens (the pending
one included) are looked up, first in the current text (prompt lookup: its latest occurrence), then in the datastore
(:class:`NGramIndex`: every occurrence, up to ``max_matches`` of them); the first n with a match decides. The
datastore's continuations form a trie whose nodes count the matches through them: a chain follows the most frequent
child, a tree (``propose_tree``, greedy decoding) keeps the ``budget`` nodes of highest count (a node's count never
exceeds its parent's, so that is a tree), at most ``topk`` children a node and ``depth`` levels, and only nodes whose
share of the matches is at least ``min_prob``. Drafts are deterministic; sampling proposes the chain (a point mass
q; siblings would need a distribution they were drawn from).
"""
from __future__ import annotations

import functools
import heapq
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError, read_json, shipped
from eval.decoding.lookup import latest_match
from models.heads.drafting import Proposal, Sampler
from models.heads.trees import TreeSpec, chain_parents

FORMAT = "draftsmith-datastore/1"
_BASE = 1_000_003  # the n-gram hash: Σ token_{i-j}·B^j in wrapping int64 arithmetic (collisions are checked)


@functools.cache
def _powers(n: int) -> torch.Tensor:
    """[B^(n-1), ..., B, 1] in int64 (made once per n: every lookup hashes its suffix)."""
    return torch.tensor([_BASE ** j % 2**63 for j in range(n - 1, -1, -1)], dtype=torch.long)


def _hash(windows: torch.Tensor) -> torch.Tensor:
    """n-gram keys: windows [..., n] long → [...] int64 (the last token weighted 1, the one before B, ...)."""
    return (windows * _powers(windows.shape[-1])).sum(-1)


class NGramIndex:
    """Every occurrence of every n-gram (n = ``min_n`` .. ``max_n``) of a token array with −1 separators, sorted by
    hash: ``starts(suffix)`` finds where what followed each occurrence begins by binary search."""

    def __init__(self, tokens: torch.Tensor, min_n: int, max_n: int):
        self.tokens = tokens.long()  # [N]
        N = self.tokens.numel()
        self.keys: dict[int, torch.Tensor] = {}
        self.next: dict[int, torch.Tensor] = {}
        for n in range(min_n, max_n + 1):
            if N <= n:
                self.keys[n] = self.next[n] = torch.empty(0, dtype=torch.long)
                continue
            win = self.tokens.unfold(0, n, 1)[: N - n]  # [N-n, n]: n-grams followed by at least one position
            ok = (win >= 0).all(-1) & (self.tokens[n:] >= 0)  # no separator inside, a token after it
            keys = _hash(win[ok])
            order = torch.argsort(keys, stable=True)  # equal keys keep text order
            self.keys[n] = keys[order]
            self.next[n] = (torch.nonzero(ok).view(-1) + n)[order]  # where the continuation starts

    def starts(self, suffix: list[int], limit: int) -> torch.Tensor:
        """Continuation starts [m] of the last ``limit`` occurrences of ``suffix`` (hash collisions removed)."""
        n = len(suffix)
        keys = self.keys.get(n)
        if keys is None or keys.numel() == 0:
            return torch.empty(0, dtype=torch.long)
        s = torch.tensor(suffix, dtype=torch.long)
        key = _hash(s).view(1)
        lo, hi = int(torch.searchsorted(keys, key)), int(torch.searchsorted(keys, key, right=True))
        starts = self.next[n][max(lo, hi - limit): hi]
        if starts.numel():
            same = (self.tokens[starts[:, None] - n + torch.arange(n)] == s).all(-1)
            starts = starts[same]
        return starts

    def continuations(self, starts: torch.Tensor, depth: int) -> list[list[int]]:
        """Up to ``depth`` tokens from each start, cut at the end of its answer."""
        N = self.tokens.numel()
        idx = (starts[:, None] + torch.arange(depth)).clamp_max(N - 1)
        rows = self.tokens[idx].masked_fill(starts[:, None] + torch.arange(depth) >= N, -1)
        out = []
        for r in rows.tolist():
            cut = r.index(-1) if -1 in r else len(r)
            if cut:
                out.append(r[:cut])
        return out


def trie_proposal(rows: list[list[int]], budget: int, depth: int, topk: int, min_share: float = 0.0) -> Proposal:
    """The continuations ``rows`` as a trie whose nodes count the rows through them → the ``budget`` nodes of highest
    count (ties: shallower, then earlier), at most ``topk`` children a node (the most frequent) and ``depth`` levels,
    each with at least ``min_share`` of the rows; a tree in topological order (``parents``, −1 the pending token)."""
    counts: Counter = Counter()
    for r in rows:
        for d in range(min(depth, len(r))):
            counts[tuple(r[: d + 1])] += 1
    children: dict[tuple, list[tuple]] = {}
    for prefix in counts:  # insertion order: the first row to reach a node first
        children.setdefault(prefix[:-1], []).append(prefix)
    m = max(len(rows), 1)
    chosen: list[tuple] = []
    heap = [(-counts[c], 1, i, c) for i, c in enumerate(sorted(children.get((), []), key=lambda c: -counts[c])[:topk])]
    heapq.heapify(heap)
    tick = len(heap)
    while heap and len(chosen) < budget:
        neg, d, _, node = heapq.heappop(heap)
        if -neg / m < min_share:
            break
        chosen.append(node)
        for c in sorted(children.get(node, []), key=lambda c: -counts[c])[:topk]:
            heapq.heappush(heap, (-counts[c], d + 1, tick, c))
            tick += 1
    chosen.sort(key=len)  # parents before children
    index = {node: i for i, node in enumerate(chosen)}
    tokens = [node[-1] for node in chosen]
    parents = [index[node[:-1]] if len(node) > 1 else -1 for node in chosen]
    return Proposal(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long))


def _chain(tokens: list[int]) -> Proposal:
    """A chain as a one-branch tree (what ``propose_tree`` returns for it)."""
    return Proposal(torch.tensor(tokens, dtype=torch.long), None, chain_parents(len(tokens)))


class DatastoreDrafter:
    """Retrieval drafting (see the module docstring): the current text first, then the datastore at ``path``.
    On the embedded target, with a datastore of its own greedy answers, it was the fastest drafter at T=0 with
    nothing trained (2.37–2.56× plain decoding against 2.05–2.32× for the shipped floor with prompt lookup; 2-core
    Intel Xeon, 2026-12-04); at T=1 it does not pay (a fixed token is accepted with the target's probability of it)."""

    def __init__(self, path: str, target: Any = None, max_ngram: int = 4, min_ngram: int = 2, max_matches: int = 64):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise UserError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: integers with 1 <= min_ngram <= max_ngram")
        if not isinstance(max_matches, int) or max_matches < 1:
            raise UserError(f"max_matches={max_matches}: the most occurrences read per lookup, an integer >= 1")
        tokens, self.info = read_datastore(path)
        vocab = getattr(getattr(target, "config", None), "vocab_size", None)
        if vocab is not None and tokens.numel() and int(tokens.max()) >= vocab:
            raise UserError(f"{path}: holds token id {int(tokens.max())}, beyond this target's vocabulary of {vocab} "
                            f"(built for {self.info.get('target', {}).get('name_or_path')!r}); build one with this target")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.index = NGramIndex(tokens, min_ngram, max_ngram)
        self.history: list[int] = []

    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        self.history = prompt_ids.view(-1).tolist()

    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        self.history += tokens.view(-1).tolist()

    def _rows(self, pending: int, depth: int) -> tuple[list[list[int]], bool]:
        """(continuations, from the current text?) of the longest suffix found."""
        h = self.history + [pending]
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            at = latest_match(h, n)
            if at is not None:
                return [h[at: at + depth]], True
            starts = self.index.starts(h[-n:], self.max_matches)
            if starts.numel():
                return self.index.continuations(starts, depth), False
        return [], False

    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        rows, _ = self._rows(pending, k)
        if not rows:
            return Proposal(torch.empty(0, dtype=torch.long))
        return Proposal(trie_proposal(rows, k, k, 1).tokens)

    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        rows, own = self._rows(pending, tree.depth)
        if not rows:
            return Proposal(torch.empty(0, dtype=torch.long), None, torch.empty(0, dtype=torch.long))
        if own or not sampler.greedy:  # the current text's one continuation; sampling: the chain
            return _chain(trie_proposal(rows, tree.depth, tree.depth, 1).tokens.tolist())
        return trie_proposal(rows, tree.budget, tree.depth, tree.topk, tree.min_prob)


# -- reading a datastore ------------------------------------------------------------------------------------------
def read_datastore(path: str | Path) -> tuple[torch.Tensor, dict]:
    from safetensors.torch import load_file

    p = Path(shipped(path))
    meta = p / "datastore.json"
    if not meta.exists() or not (p / "tokens.safetensors").exists():
        raise UserError(f"{path}: not a datastore (no datastore.json / tokens.safetensors); build one with "
                        "`python -m eval.datastore sources=[...] out=...`")
    return load_file(str(p / "tokens.safetensors"))["tokens"].long(), read_json(meta, FORMAT)
