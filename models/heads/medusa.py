"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774): K parallel heads on the target's last hidden state.

Head k (0-based) is ``W2_k(h + SiLU(W1_k h))`` and predicts token t+2+k from the last hidden state h_t
(the target's own head predicts t+1). ``W2_k`` starts as a copy of the target's ``lm_head``, ``W1_k`` at zero,
so an untrained head k repeats the target's next-token guess. Loss ``Σ_k step_decay**k · CE`` on the data
tokens (``soft=true``: against the target's distribution at t+1+k instead). Proposals chain each head's
top-1 (or a sample at T>0), or grow a tree (:func:`models.heads.trees.grow_tree`) whose nodes at depth d all take
their children from head d: the heads see neither the pending token nor the drafts, as in Medusa-1, so every
node of a level has the same candidates (Medusa's tree of top-k products, here grown by path probability).

``sequential=true`` makes the heads sequentially dependent, as Hydra's (Ankner et al., "Hydra: Sequentially-Dependent
Draft Heads for Medusa Decoding", arXiv 2402.05109): head k reads ``x = [h_t; E(x_{t+1}); ...; E(x_{t+1+k})]``, the
state and the embeddings (the target's own, frozen) of the pending token and the k drafts before its token, through
a first block ``P_k x + SiLU(W1_k x)`` with ``P_k`` [d, (k+2)d] starting as the identity on h (so the untrained head
is Medusa's) and ``W1_k`` at zero. Training teacher-forces the data tokens; a tree node's children come from its
own path. Medusa-1 heads guess token t+2 without the token t+1 the target just chose; Hydra's first head sees it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data.errors import UserError
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Proposal, Sampler, draw, proposal
from models.heads.trees import TreeSpec, grow_tree, node_depths, path_to
from models.layers import frozen_embedding, lookahead_loss, shift_left


class ResBlock(nn.Module):
    """h + SiLU(W1 h), W1 zero-initialised (Medusa)."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class GroundedBlock(nn.Module):
    """Hydra's first block: x [..., n·d] (h and n−1 token embeddings) → ``P x + SiLU(W x)`` [..., d], with P the
    identity on h and zero elsewhere, W zero: the untrained block passes h through, as Medusa's ResBlock does."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.linear = nn.Linear(n * d, d)
        self.proj = nn.Linear(n * d, d, bias=False)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, :d].copy_(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + F.silu(self.linear(x))


class MedusaHead(DraftHead):
    family = "medusa"
    reads_taps = False  # the heads read the final-norm feature
    needs_teacher_logits = True  # accuracy is measured against the target's own top-1

    def __init__(self, target: Any, num_heads: int = 4, num_layers: int = 1, step_decay: float = 0.8, soft: bool = False,
                 sequential: bool = False):
        super().__init__(target, num_heads=num_heads, num_layers=num_layers, step_decay=step_decay, soft=soft,
                         sequential=sequential)
        if num_heads < 1 or num_layers < 1:
            raise UserError(f"draft.num_heads={num_heads}, draft.num_layers={num_layers}: both must be >= 1")
        d, V = target.config.hidden_size, target.config.vocab_size
        w = target.lm_head().weight.data.float()

        def block(k: int) -> nn.Sequential:  # head k's residual blocks; Hydra's first one reads h and k+1 embeddings
            first = GroundedBlock(d, k + 2) if sequential else ResBlock(d)
            return nn.Sequential(first, *[ResBlock(d) for _ in range(num_layers - 1)])

        self.blocks = nn.ModuleList([block(k) for k in range(num_heads)])
        self.heads = nn.ModuleList([nn.Linear(d, V, bias=False) for _ in range(num_heads)])
        for h in self.heads:
            h.weight.data.copy_(w)
        self.step_decay, self.soft, self.sequential = step_decay, soft, sequential
        if sequential:
            self.embed_tokens = frozen_embedding(target.embed_tokens().weight)  # [V, d]

    @property
    def num_steps(self) -> int:
        return len(self.heads)

    @property
    def max_draft(self) -> int:
        return self.num_steps  # one head per drafted token

    def logits(self, h: torch.Tensor, n: int | None = None) -> list[torch.Tensor]:
        """Medusa: h [..., d] → one [..., V] per head, for the first ``n`` heads (default: all; drafting k tokens
        needs k)."""
        return [self.head_logits(k, h) for k in range(self.num_steps)[:n]]

    def head_logits(self, k: int, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's logits [..., V] from h [..., d] and, with ``sequential``, the tokens [..., k+1] it reads (the
        pending token and the k drafts before its own)."""
        x = h.to(self.heads[0].weight.dtype)
        if self.sequential:
            e = self.embed_tokens(tokens).to(x.dtype)  # [..., k+1, d]
            x = torch.cat([x, e.flatten(-2)], dim=-1)  # [..., (k+2)·d]
        return self.heads[k](self.blocks[k](x))

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        h = feats.last_state[0, at]  # [d]
        return torch.stack([self.head_logits(k, h, ids[0, at + 1: at + 2 + k]) for k in range(steps)]).float()

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        t_top = feats.logits.argmax(-1)  # [B, T]
        K = self.num_steps
        loss = feats.last_state.new_zeros(())
        correct, total = torch.zeros(K, device=ids.device), torch.zeros(K, device=ids.device)
        h = feats.last_state.to(self.heads[0].weight.dtype)  # [B, T, d]
        x = h
        for k, (block, head) in enumerate(zip(self.blocks, self.heads)):
            if self.sequential:  # position t reads E(x_{t+1+k}) too: x [B, T, (k+2)·d]
                x = torch.cat([x, self.embed_tokens(shift_left(ids, 1 + k)).to(h.dtype)], dim=-1)
            lk, correct[k], total[k] = lookahead_loss(x, lambda z, b=block, o=head: o(b(z)), ids, loss_mask, valid,
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
        for j in range(min(k, self.num_steps)):
            read = torch.tensor([pending] + tokens) if self.sequential else None  # Medusa's heads read no tokens
            t, q = draw(self.head_logits(j, self._h, read), sampler)
            tokens.append(int(t))
            probs.append(q)
        return proposal(tokens, probs)

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree at most ``num_heads`` deep: the children of every node at depth d (the root: 0) come from
        head d's logits on the stored state, the same logits ``propose`` draws its token d+1 from (``sequential``:
        with the node's own path, one row per node)."""
        tree = self.within_reach(tree)
        root = torch.tensor([pending])
        heads = self.logits(self._h, tree.depth) if not self.sequential else None  # Medusa: tree.depth × [V], once

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            depth = int(node_depths(parents)[nodes[0]])  # all nodes of a call share one depth
            if heads:
                return heads[depth].expand(len(nodes), -1)  # [len(nodes), V]
            paths = torch.stack([torch.cat([root, tokens[path_to(n, parents)]]) for n in nodes])  # [n, depth+1]
            return self.head_logits(depth, self._h.expand(len(nodes), -1), paths)  # [len(nodes), V]

        return grow_tree(heads[0] if heads else self.head_logits(0, self._h, root), expand, tree, sampler)
