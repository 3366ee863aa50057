"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774): K parallel heads on the target's last hidden state.

Head k (0-based) is ``W2_k(h + SiLU(W1_k h))`` and predicts token t+2+k from the last hidden state h_t
(the target's own head predicts t+1). ``W2_k`` starts as a copy of the target's ``lm_head``, ``W1_k`` at zero,
so an untrained head k repeats the target's next-token guess. Loss ``Σ_k step_decay**k · CE`` on the data
tokens (``soft=true``: against the target's distribution at t+1+k instead). Proposals chain each head's
top-1 (or a sample at T>0), or grow a tree (:func:`models.heads.trees.grow_tree`) whose nodes at depth d all take
their children from head d: the heads see neither the pending token nor the drafts, as in Medusa-1, so every
node of a level has the same candidates (Medusa's tree of top-k products, here grown by path probability).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data.errors import UserError
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Proposal, Sampler, draw, proposal
from models.heads.trees import TreeSpec, grow_tree, node_depths
from models.layers import lookahead_loss


class ResBlock(nn.Module):
    """h + SiLU(W1 h), W1 zero-initialised (Medusa)."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHead(DraftHead):
    family = "medusa"
    reads_taps = False  # the heads read the final-norm feature
    needs_teacher_logits = True  # accuracy is measured against the target's own top-1

    def __init__(self, target: Any, num_heads: int = 4, num_layers: int = 1, step_decay: float = 0.8, soft: bool = False):
        super().__init__(target, num_heads=num_heads, num_layers=num_layers, step_decay=step_decay, soft=soft)
        if num_heads < 1 or num_layers < 1:
            raise UserError(f"draft.num_heads={num_heads}, draft.num_layers={num_layers}: both must be >= 1")
        d, V = target.config.hidden_size, target.config.vocab_size
        w = target.lm_head().weight.data.float()
        self.blocks = nn.ModuleList([nn.Sequential(*[ResBlock(d) for _ in range(num_layers)]) for _ in range(num_heads)])
        self.heads = nn.ModuleList([nn.Linear(d, V, bias=False) for _ in range(num_heads)])
        for h in self.heads:
            h.weight.data.copy_(w)
        self.step_decay, self.soft = step_decay, soft

    @property
    def num_steps(self) -> int:
        return len(self.heads)

    @property
    def max_draft(self) -> int:
        return self.num_steps  # one head per drafted token

    def logits(self, h: torch.Tensor, n: int | None = None) -> list[torch.Tensor]:
        """h [..., d] → one [..., V] per head, for the first ``n`` heads (default: all; drafting k tokens needs k)."""
        h = h.to(self.heads[0].weight.dtype)
        return [head(block(h)) for block, head in list(zip(self.blocks, self.heads))[:n]]

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        return torch.stack([lg[0, at] for lg in self.logits(feats.last_state, steps)]).float()

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        t_top = feats.logits.argmax(-1)  # [B, T]
        K = self.num_steps
        loss = feats.last_state.new_zeros(())
        correct, total = torch.zeros(K, device=ids.device), torch.zeros(K, device=ids.device)
        h = feats.last_state.to(self.heads[0].weight.dtype)  # [B, T, d]
        for k, (block, head) in enumerate(zip(self.blocks, self.heads)):
            lk, correct[k], total[k] = lookahead_loss(h, lambda x, b=block, o=head: o(b(x)), ids, loss_mask, valid,
                                                      t_top, 1 + k, feats.logits if self.soft else None)
            loss = loss + self.step_decay ** k * lk  # head k learns token t+2+k
        return HeadOutput(loss=loss, correct=correct, total=total)

    # -- inference ------------------------------------------------------------------------------
    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        self._h = feats.last_state[0, -1]  # [d] the state that predicted the pending token

    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        self._h = feats.last_state[0, -1]

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        tokens, probs = [], []
        for logits in self.logits(self._h, k):
            t, q = draw(logits, sampler)
            tokens.append(int(t))
            probs.append(q)
        return proposal(tokens, probs)

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree at most ``num_heads`` deep: the children of every node at depth d (the root: 0) come from
        head d's logits on the stored state, the same logits ``propose`` draws its token d+1 from."""
        tree = self.within_reach(tree)
        heads = self.logits(self._h, tree.depth)  # tree.depth × [V]

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            depth = int(node_depths(parents)[nodes[0]])  # all nodes of a call share one depth
            return heads[depth].expand(len(nodes), -1)  # [len(nodes), V]

        return grow_tree(heads[0], expand, tree, sampler)
