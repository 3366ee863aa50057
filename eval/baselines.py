"""Drafters that need no training on target features: n-gram prompt lookup and an independent small draft model."""
from __future__ import annotations

from typing import Any

import torch

from eval.decoder import crop
from models.heads.drafting import Proposal, Sampler, draw, proposal
from models.target import TargetOutput


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
            suffix = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # latest match first
                if h[start: start + n] == suffix:
                    cont = h[start + n: start + n + k]
                    if cont:
                        return Proposal(tokens=torch.tensor(cont, dtype=torch.long))
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
