"""Drafters that need no training on target features: n-gram prompt lookup and an independent small draft model;
and a trained head with prompt lookup (:class:`LookupUnion`)."""
from __future__ import annotations

from typing import Any

import torch

from data.errors import UserError
from eval.decoding.decoder import crop
from models.heads.drafting import Proposal, Sampler, draw, proposal
from models.heads.trees import chain_parents
from models.target import TargetOutput


def latest_match(history: list[int], n: int) -> int | None:
    """Prompt lookup: where the continuation of the latest earlier occurrence of ``history``'s last n tokens begins
    (the occurrence at the very end excluded), or None."""
    suffix = history[-n:]
    for start in range(len(history) - n - 1, -1, -1):
        if history[start: start + n] == suffix:
            return start + n
    return None


class NGramDrafter:
    """Prompt lookup decoding (Saxena 2023; vLLM's ``ngram``): find the latest earlier occurrence of the
    longest suffix of the text (``max_ngram`` down to ``min_ngram`` tokens) and propose what followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []

    def start(self, prompt_ids: torch.Tensor, feats: TargetOutput | None) -> None:
        self.history = prompt_ids.view(-1).tolist()

    def commit(self, tokens: torch.Tensor, feats: TargetOutput | None) -> None:
        self.history += tokens.view(-1).tolist()

    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        h = self.history + [pending]
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            at = latest_match(h, n)
            if at is not None:
                return Proposal(tokens=torch.tensor(h[at: at + k], dtype=torch.long))
        return Proposal(tokens=torch.empty(0, dtype=torch.long))


class ModelDrafter:
    """The classic independent draft model: a small causal LM with the target's tokenizer and its own KV cache."""

    def __init__(self, model: Any):
        self.model = model.eval()
        self.cache = None
        self.seen: list[int] = []   # tokens in the draft's cache
        self.known: list[int] = []  # all tokens so far (prompt + accepted), excluding the pending one

    def start(self, prompt_ids: torch.Tensor, feats: TargetOutput | None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.seen, self.known = [], prompt_ids.view(-1).tolist()

    def commit(self, tokens: torch.Tensor, feats: TargetOutput | None) -> None:
        self.known += tokens.view(-1).tolist()

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        full = self.known + [pending]
        # keep the cache's longest prefix that is still part of the text, then feed the rest
        common = 0
        for a, b in zip(self.seen, full):
            if a != b:
                break
            common += 1
        common = min(common, len(full) - 1)
        crop(self.cache, common)
        self.seen = full[:common]
        feed = torch.tensor([full[common:]])
        tokens, probs = [], []
        for j in range(k):
            logits = self.model(input_ids=feed, cache=self.cache, use_cache=True).logits[0, -1]
            self.seen += feed[0].tolist()
            t, q = draw(logits, sampler)
            t = int(t)
            tokens.append(t)
            probs.append(q)
            feed = torch.tensor([[t]])
        return proposal(tokens, probs)


class LookupUnion:
    """A trained head and prompt lookup (:class:`NGramDrafter`) as one drafter.

    Prompt lookup is often right for many tokens in a row where the text repeats (code, names and phrases of the
    prompt), where a head's acceptance decays with depth; elsewhere it matches little, and it costs nothing to draft.
    Greedy decoding: wherever the lookup finds a match its ``lookup_k`` tokens draft the round alone (a one-branch
    tree that no k cuts), and the head drafts wherever it finds none. The head catches up on the rounds it sat out at
    its next draft (the drafting contract's commit after commit); those rounds do not enter ``k=auto``'s estimates
    (``Proposal.usual``). Letting the head sit out every matched round was the fastest way measured to combine the
    two: the shipped SmolLM2 floor with it ran 1.58–1.67× plain decoding at T=0 against 1.46–1.52× for the head's
    tree with the lookup as one more branch of every round (6 prompts a set, 2-core AMD EPYC, 2026-12-02).
    ``min_ngram`` (of the lookup) 2 leaves out one-token matches, which are seldom right and cost verify rows.

    Sampling (T > 0): the head draws its chain or tree from its q as always and the lookup never drafts alone (its
    tokens are accepted only with the target's own probability of them, below a sampled head's acceptance). With
    ``sampled_union`` the lookup's continuation joins the head's draft as point-mass nodes (``Proposal.point``),
    walked from the root, following nodes that already hold its tokens and adding the rest: the decoder tries each
    after its sampled siblings, as a candidate of its own (lossless: recursive rejection with one draft distribution
    per candidate, SpecInfer). A round whose lookup branch reaches deeper than the head drafted stays out of
    ``k=auto``'s estimates, which then measure the head's depths. Off by default (the head drafts alone): it paid on
    code, where the text repeats, and only there (the SmolLM2 floor at T=1 on HumanEval: 1.36–1.57× plain decoding
    against 1.10–1.22× without it; MT-Bench and ShareGPT within ±5%; 2-core Intel Xeon, 2026-12-05)."""

    def __init__(self, head: Any, lookup: Any, lookup_k: int = 8, sampled_union: bool = False):
        if not isinstance(lookup_k, int) or lookup_k < 1:
            raise UserError(f"lookup_k={lookup_k}: the most tokens the lookup branch adds, an integer >= 1")
        self.head, self.lookup, self.lookup_k = head, lookup, lookup_k
        self.sampled_union = bool(sampled_union)
        self._chain: list[int] = []  # the lookup branch of the last proposal
        self._depth: int | None = None  # when sampling: the head's depth this round
        self.max_draft = getattr(head, "max_draft", None)  # what k=auto may ask of the head
        if hasattr(head, "tap_layers"):  # the target features the head reads (eval.run sets the target's taps)
            self.tap_layers = head.tap_layers
        if hasattr(head, "propose_tree"):
            self.propose_tree = self._propose_tree

    def start(self, prompt_ids: torch.Tensor, feats: TargetOutput | None) -> None:
        self.head.start(prompt_ids, feats)
        self.lookup.start(prompt_ids, feats)
        self._chain = []

    def commit(self, tokens: torch.Tensor, feats: TargetOutput | None) -> None:
        self.head.commit(tokens, feats)
        self.lookup.commit(tokens, feats)
        self._chain = []

    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        alone = self._look(pending, sampler, k)
        return alone if alone is not None else self._with_lookup(self.head.propose(pending, k, sampler), k)

    def _propose_tree(self, pending: int, tree: Any, sampler: Sampler) -> Proposal:
        alone = self._look(pending, sampler, tree.depth)
        return alone if alone is not None else self._with_lookup(self.head.propose_tree(pending, tree, sampler), None)

    def _look(self, pending: int, sampler: Sampler, depth: int) -> Proposal | None:
        """Look up this round's continuation (``_chain``: up to ``lookup_k`` tokens; empty without a match, or at T>0
        without ``sampled_union``). Greedy with a match: returns it as the round's whole proposal (a one-branch tree,
        so that no k cuts it). Else None: the head drafts (to ``depth``) and, when sampling, :meth:`_with_lookup`
        merges ``_chain`` into its draft."""
        look = sampler.greedy or self.sampled_union
        self._chain = self.lookup.propose(pending, self.lookup_k, sampler).tokens.tolist() if look else []
        self._depth = None if sampler.greedy else depth
        if not sampler.greedy or not self._chain:
            return None
        return Proposal(torch.tensor(self._chain), None, chain_parents(len(self._chain)), usual=False)

    def _with_lookup(self, prop: Proposal, k: int | None) -> Proposal:
        chain = self._chain
        if not chain:  # sampling, or nothing to look up
            return prop
        tokens = (prop.tokens if k is None or prop.parents is not None else prop.tokens[:k]).tolist()
        parents = prop.parents.tolist() if prop.parents is not None else list(range(-1, len(tokens) - 1))
        n0, node = len(tokens), -1
        for t in chain:  # follow the nodes that hold the lookup's tokens, add the rest below the last one found
            child = next((i for i, (tok, par) in enumerate(zip(tokens, parents)) if par == node and tok == t), None)
            if child is None:
                tokens.append(t)
                parents.append(node)
                child = len(tokens) - 1
            node = child
        if len(tokens) == n0:
            return prop  # nothing new: the head's own proposal, chain or tree
        probs = point = None
        if prop.probs is not None:  # sampled: the new nodes are point masses beside the head's drawn nodes
            probs = prop.probs[:n0]
            probs = torch.cat([probs, probs.new_zeros(len(tokens) - n0, probs.shape[-1])])
            point = torch.arange(len(tokens)) >= n0
        deep = self._depth is not None and len(chain) > self._depth  # sampling, deeper than the head
        return Proposal(torch.tensor(tokens, dtype=torch.long), probs, torch.tensor(parents, dtype=torch.long),
                        point=point, usual=not deep)
