"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774): K parallel heads on the target's last hidden state.

Head k (0-based) is ``W2_k(h + SiLU(W1_k h))`` and predicts token t+2+k from the last hidden state h_t
(the target's own head predicts t+1). ``W2_k`` starts as a copy of the target's ``lm_head``, ``W1_k`` at zero,
so an untrained head k repeats the target's next-token guess. Loss
``Σ_k step_decay**k · CE`` on the data tokens (``soft=true``: against the target's distribution at t+1+k instead).
Proposals chain each head's top-1 (or a sample at T>0), or grow a tree (:func:`models.heads.trees.grow_tree`) whose nodes at depth d all take
their children from head d: the heads see neither the pending token nor the drafts, as in Medusa-1, so every
node of a level has the same candidates (Medusa's tree of top-k products, here grown by path probability).

``sequential=true`` makes the heads sequentially dependent, as Hydra's (Ankner et al., "Hydra: Sequentially-Dependent
Draft Heads for Medusa Decoding", arXiv 2402.05109): head k reads ``x = [h_t; E(x_{t+1}); ...; E(x_{t+1+k})]``, the
state and the embeddings (the target's own, frozen) of the pending token and the k drafts before its token, through
a first block ``P_k x + SiLU(W1_k x)`` with ``P_k`` [d, (k+2)d] starting as the identity on h (so the untrained head
is Medusa's) and ``W1_k`` at zero. Training teacher-forces the data tokens; a tree node's children come from its
own path. Medusa-1 heads guess token t+2 without the token t+1 the target just chose; Hydra's first head sees it.

``prefix: tokens`` puts one decoder layer before the heads, which then read its output u_t in place of h_t: causal
self-attention, as Hydra++'s prefix attention, but over ``fc([h_s; E(x_{s+1})])``, each position's state beside the
embedding of the token after it (EAGLE's input; ours, not Hydra's), so attention can look for that token earlier in
the text. The layer's output projections start at zero and ``fc`` as the identity on h: the untrained layer passes h
through. Decoding keeps the layer's keys over the committed text and runs it once a round, over the rows committed
since the last round. It costs one decoder step a round (on the 6-layer embedded target a sixth of a target step) and
keeps learning where the heads alone stop: Hydra's heads with it, 30 minutes on the embedded target's sampled
answers, drafted τ 3.01 / 2.23 / 2.22 at T=0 (MT-Bench / HumanEval / ShareGPT) against 1.93 / 1.78 / 1.71 without it
and 1.22 / 1.15 / 1.18× plain decoding against 1.10 / 1.11 / 1.16×; at T=1 τ 1.84 / 2.13 / 1.95 against 1.63 / 1.80 /
1.79, speed 0.99 / 1.05 / 1.00× against 1.10 / 1.08 / 1.12× (2-core Intel Xeon, 2026-12-06). Off by default: the
heads without it are the cheaper drafter at T=1.
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
from models.layers import (DecoderLayer, KVBuffer, Rotary, attention_shape, frozen_embedding,
                           lookahead_loss, shift_left)
from models.target import rope_theta

PREFIXES = (None, "tokens")


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


class PrefixLayer(nn.Module):
    """A prefix attention layer (after Hydra++'s): one target-shaped decoder layer over ``fc([h_s; E(x_{s+1})])``,
    its ``o_proj``/``down_proj`` at zero and ``fc`` the identity on h, so that the untrained layer passes h through."""

    def __init__(self, target: Any):
        super().__init__()
        tc = target.config
        d = tc.hidden_size
        n_heads, n_kv, head_dim = attention_shape(tc)
        self.layer = DecoderLayer(d, n_heads, n_kv, tc.intermediate_size, head_dim, getattr(tc, "rms_norm_eps", 1e-6))
        nn.init.zeros_(self.layer.self_attn.o_proj.weight)
        nn.init.zeros_(self.layer.mlp.down_proj.weight)
        self.rotary = Rotary(head_dim, rope_theta(tc))
        self.fc = nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :d].copy_(torch.eye(d))

    def forward(self, h: torch.Tensor, e: torch.Tensor, past: KVBuffer | None = None) -> torch.Tensor:
        """h [B, m, d] the target's states at m consecutive positions, e [B, m, d] the embeddings of the tokens after
        them; past: the keys of the P positions before them (None: training, causal over the m). Returns u [B, m, d];
        with past, these positions' keys are added to it (the caller keeps or drops them)."""
        x = self.fc(torch.cat([h, e], dim=-1))  # [B, m, d]
        P = past.n if past is not None else 0
        cos, sin = self.rotary(range(P, P + x.shape[1]))
        if past is None:
            return self.layer(x, cos, sin)  # causal
        return self.layer.cached(x, cos, sin, past)[0]


class MedusaHead(DraftHead):
    family = "medusa"
    reads_taps = False  # the heads read the final-norm feature
    needs_teacher_logits = True  # accuracy is measured against the target's own top-1

    def __init__(self, target: Any, num_heads: int = 4, num_layers: int = 1, step_decay: float = 0.8, soft: bool = False,
                 sequential: bool = False, prefix: str | None = None):
        super().__init__(target, num_heads=num_heads, num_layers=num_layers, step_decay=step_decay, soft=soft,
                         sequential=sequential, prefix=prefix)
        if num_heads < 1 or num_layers < 1:
            raise UserError(f"draft.num_heads={num_heads}, draft.num_layers={num_layers}: both must be >= 1")
        if prefix not in PREFIXES:
            raise UserError(f"draft.prefix={prefix!r}: null (no layer) or tokens (a prefix attention layer that reads "
                            "each state beside the next token)")
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
        if sequential or prefix:
            self.embed_tokens = frozen_embedding(target.embed_tokens().weight)  # [V, d]
        if prefix:
            self.prefix = PrefixLayer(target)

    @property
    def num_steps(self) -> int:
        return len(self.blocks)

    def out(self, k: int) -> nn.Linear:
        """Head k's output layer (its own copy of the target's head, trained)."""
        return self.heads[k]

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
        x = h.to(self.out(0).weight.dtype)
        if self.sequential:
            e = self.embed_tokens(tokens).to(x.dtype)  # [..., k+1, d]
            x = torch.cat([x, e.flatten(-2)], dim=-1)  # [..., (k+2)·d]
        return self.out(k)(self.blocks[k](x))

    def features(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What the heads read at each position, [B, T, d]: the target's states h [B, T, d] (ids [B, T]), through the
        prefix layer where there is one (position t reads token t+1)."""
        h = h.to(self.out(0).weight.dtype)
        if not hasattr(self, "prefix"):
            return h
        return self.prefix(h, self.embed_tokens(shift_left(ids, 1)).to(h.dtype))

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        h = self.features(feats.last_state, ids)[0, at]  # [d] (causal: later positions do not change it)
        return torch.stack([self.head_logits(k, h, ids[0, at + 1: at + 2 + k]) for k in range(steps)]).float()

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        t_top = feats.all_logits().argmax(-1)  # [B, T]
        K = self.num_steps
        loss = feats.last_state.new_zeros(())
        correct, total, accepted = (torch.zeros(K, device=ids.device) for _ in range(3))
        h = self.features(feats.last_state, ids)  # [B, T, d]
        x = h
        for k, block in enumerate(self.blocks):
            head = self.out(k)
            if self.sequential:  # position t reads E(x_{t+1+k}) too: x [B, T, (k+2)·d]
                x = torch.cat([x, self.embed_tokens(shift_left(ids, 1 + k)).to(h.dtype)], dim=-1)
            lk, correct[k], total[k], accepted[k] = lookahead_loss(
                x, lambda z, b=block, o=head: o(b(z)), ids, loss_mask, valid, t_top, 1 + k,
                feats.all_logits() if self.soft else None)
            loss = loss + self.step_decay ** k * lk  # head k learns token t+2+k
        return HeadOutput(loss=loss, correct=correct, total=total, accepted=accepted if self.soft else None)

    # -- inference ------------------------------------------------------------------------------
    # State: _hold [1, r, d] the target's states at committed positions the prefix layer has not cached yet (r >= 1:
    # the last one predicted the pending token); _nxt [1, r-1] the tokens after all but the last of them; _kv the
    # layer's keys over the positions before. ``propose`` runs the layer once over the r rows, the pending token
    # after the last, and adds their keys; ``commit`` keeps them (the pending token is the target's own and stays),
    # so a round costs one call of the layer. Without a prefix layer r = 1 and _hold is h_t.
    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        self._hold = feats.last_state[:1].to(self.out(0).weight.dtype)  # [1, P, d]
        self._nxt = prompt_ids.view(1, -1)[:, 1:].to(self._hold.device)  # [1, P-1]
        self._proposed: int | None = None  # the pending token whose rows propose added to _kv
        if hasattr(self, "prefix"):
            self._kv = KVBuffer()
        else:
            self._hold = self._hold[:, -1:]

    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        """Accepted tokens ``[x, d_1..d_n]`` and their states."""
        h = feats.last_state[:1].to(self._hold)  # [1, m, d]
        tokens = tokens.view(1, -1).to(self._hold.device)
        if not hasattr(self, "prefix"):
            self._hold = h[:, -1:]
        elif self._proposed == int(tokens[0, 0]):  # propose ran on the held rows with x: their keys stay
            self._kv.keep()
            self._hold, self._nxt = h, tokens[:, 1:]
        else:  # no propose this round (another drafter drafted it): the rows wait for the next one
            self._kv.keep(0)
            self._hold, self._nxt = torch.cat([self._hold, h], 1), torch.cat([self._nxt, tokens], 1)
        self._proposed = None

    def _state(self, pending: int) -> torch.Tensor:
        """What the heads read this round, [d]: the last held state, through the prefix layer (all held rows at once,
        the pending token after the last; their keys added, kept by ``commit``)."""
        if not hasattr(self, "prefix"):
            return self._hold[0, -1]
        self._kv.keep(0)  # a second propose of the same round recomputes the rows
        nxt = torch.cat([self._nxt, self._nxt.new_tensor([[pending]])], 1)  # [1, r]
        e = self.embed_tokens(nxt).to(self._hold.dtype)  # [1, r, d]
        self._proposed = pending
        return self.prefix(self._hold, e, self._kv)[0, -1]

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        tokens, probs = [], []
        u = self._state(pending)  # [d]
        for j in range(min(k, self.num_steps)):
            read = torch.tensor([pending] + tokens) if self.sequential else None  # Medusa's heads read no tokens
            t, q = draw(self.head_logits(j, u, read), sampler)
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
        u = self._state(pending)  # [d]
        heads = self.logits(u, tree.depth) if not self.sequential else None  # Medusa: tree.depth × [V], once

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            depth = int(node_depths(parents)[nodes[0]])  # all nodes of a call share one depth
            if heads:
                return heads[depth].expand(len(nodes), -1)  # [len(nodes), V]
            paths = torch.stack([torch.cat([root, tokens[path_to(n, parents)]]) for n in nodes])  # [n, depth+1]
            return self.head_logits(depth, u.expand(len(nodes), -1), paths)  # [len(nodes), V]

        return grow_tree(heads[0] if heads else self.head_logits(0, u, root), expand, tree, sampler)
