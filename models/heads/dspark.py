"""DSpark (DeepSeek-AI + PKU, arXiv 2607.05147): DFlash plus a light sequential Markov head and a confidence head.

- Backbone: :class:`models.heads.dflash.DFlashHead`, but every slot predicts, the anchor slot too: slot k
  (0..B−1, at position a+k) gives logits ``U_k`` for token a+1+k (B predictions per block).
- Markov head: ``p_k(v) = softmax(U_k(v) + B(x_{k−1}, v))`` with ``B = W2(W1[x_{k−1}])``, ``W1 = Embedding(V, r)``,
  ``W2 = Linear(r, V)`` (zero-initialised, so it starts as plain DFlash); x_{k−1} is the token at the
  slot's own position (the anchor for k=0): teacher-forced in training, drafted left to right at inference.
- Confidence head: ``c_k = σ(wᵀ[h_k; W1[x_{k−1}]])`` trained towards ``1 − ½‖p_draft − p_target‖₁`` (the
  probability that a sampled draft token is accepted), as the paper's, so exports carry it; decoding does not cut
  blocks by it: a cut where the running product fell below 0.3 drafted a lower τ than ``k=auto``'s lengths on every
  set and temperature and ran slower in five of six (embedded target, 2-core Intel Xeon, 2026-12-01).
- Trees (:meth:`DSparkHead.propose_tree`): slot d−1 with the Markov term of the node's own token gives the
  children of a node at depth d−1; trees stop by ``tree.min_prob`` on the draft's path probability.
- ``draft_vocab_size`` (:class:`models.heads.dflash.DFlashHead`'s): the head reads the draft vocabulary's rows only
  and W2 projects onto them (as speculators' DSpark); TV counts the target's mass outside it whole (the draft has none there), which is exact.
- Loss ``0.1·CE + 0.9·TV + 1.0·conf`` per slot, weighted ``exp(−k/γ)``; TV and the confidence target need
  the target's distribution (from its last hidden state through its head).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.heads.base import HeadOutput
from models.heads.drafting import Proposal, Sampler, proposal
from models.heads.dflash import DFlashHead, block_targets
from models.heads.trees import TreeSpec, grow_tree, node_depths
from models.heads.vocab import spread
from models.layers import row_ce


class DSparkHead(DFlashHead):
    family = "dspark"

    def __init__(self, target: Any, block_size: int = 8, num_layers: int = 2, num_anchors: int = 32,
                 gamma: float | None = None, mask_token_id: int | None = None, rms_eps: float = 1e-6,
                 markov_rank: int = 256,
                 loss_weights: tuple[float, float, float] = (0.1, 0.9, 1.0), qk_norm: bool = False,
                 draft_vocab_size: int | None = None):
        super().__init__(target, block_size, num_layers, num_anchors, gamma, mask_token_id, rms_eps, qk_norm,
                         draft_vocab_size=draft_vocab_size)
        self.init_args.update(markov_rank=markov_rank, loss_weights=list(loss_weights))
        d, V = target.config.hidden_size, target.config.vocab_size
        r = min(markov_rank, V)
        self.markov_in = nn.Embedding(V, r)          # W1
        self.markov_out = nn.Linear(r, self.draft_vocab_size or V, bias=False)  # W2, onto the draft vocabulary's columns
        nn.init.zeros_(self.markov_out.weight)
        self.confidence = nn.Linear(d + r, 1)
        self.loss_weights = tuple(loss_weights)
        self.first_slot = 0  # every slot predicts, the anchor's too: a block drafts B tokens

    def serving_dims(self) -> dict:
        return super().serving_dims() | {"markov_rank": self.markov_in.embedding_dim}

    def slot_outputs(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., d] slot states, prev [...] previous target ids → (logits [..., Vd or V], confidence logit [...])."""
        m = self.markov_in(prev)  # [..., r]
        logits = self.rows_logits(h) + self.markov_out(m)
        conf = self.confidence(torch.cat([h, m.to(h.dtype)], -1)).squeeze(-1)
        return logits, conf

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        h = self.anchored_hidden(ids, feats, at)[:steps]  # slot k (position at+1+k) predicts token at+2+k
        prev = ids[0, at + 1: at + 1 + steps]  # x_{k-1}: the pending token, then the drafts
        logits = self.slot_outputs(h, prev)[0].float()  # [steps, Vd or V]
        return spread(logits, self.draft_ids(), self.lm_head.out_features, float("-inf")) if self.draft_vocab_size else logits

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        T = ids.shape[1]
        anchors, ok = self.sample_anchors(loss_mask, valid)  # [B, N]
        pos, labels, w = block_targets(ids, loss_mask, valid, anchors, ok, self.block_size, self.gamma, shift=1)
        posc = pos.clamp(max=T - 1).flatten(1)  # slot k (position a+k) predicts token a+k+1
        prev = ids.gather(1, posc).view_as(labels)  # x_{k-1}: the anchor, then the teacher-forced tokens
        h = self.block_hidden(ids, anchors, ok, feats.tap_states)  # [B, N, blk, d]
        rows = (w > 0).nonzero(as_tuple=True)  # the M scored slots: only they are projected onto the vocabulary
        logits, conf = self.slot_outputs(h[rows], prev[rows])  # [M, V], [M]
        b = rows[0]
        t, inv = feats.logits_at(b, posc.view_as(labels)[rows])  # [U, V] the target's for token pos+1, [M] into them
        t_top = t.argmax(-1)[inv]  # [M]
        p_d = torch.softmax(logits.float(), -1)  # [M, Vd or V]
        if self.draft_vocab_size:  # the draft puts no mass outside its vocabulary: that mass counts whole in TV
            lse = torch.logsumexp(t.float(), -1, keepdim=True)  # [U, 1]
            p_t = (t[:, self.draft_ids()].float() - lse).exp()[inv]  # [M, Vd]
            tv = 0.5 * ((p_d - p_t).abs().sum(-1) + (1 - p_t.sum(-1)).clamp(min=0))  # [M]
        else:
            p_t = torch.softmax(t.float(), -1)[inv]  # [M, V]
            tv = 0.5 * (p_d - p_t).abs().sum(-1)  # [M]
        lab, keep = self.draft_labels(labels[rows])
        ce = row_ce(logits, labels=lab) * keep  # [M]: a label outside the draft vocabulary is not scored
        conf_loss = F.binary_cross_entropy_with_logits(conf.float(), (1 - tv).detach().clamp(0, 1), reduction="none")
        a, c_tv, c_conf = self.loss_weights
        per = a * ce + c_tv * tv + c_conf * conf_loss
        n = float(max(b.numel(), 1))
        loss = (per * w[rows]).sum() / n
        with torch.no_grad():
            slot, blk = rows[2], w.shape[-1]
            hit = (self.column_ids(logits.argmax(-1)) == t_top).float()
            correct = torch.bincount(slot, weights=hit, minlength=blk).float()
            total = torch.bincount(slot, minlength=blk).float()
            metrics = {"tv": tv.sum() / n, "confidence": torch.sigmoid(conf).sum() / n}
        return HeadOutput(loss=loss, correct=correct, total=total, metrics=metrics)

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        k = min(k, self.max_draft)
        h = self._full_block(pending)[:k]  # [k, d]: the whole block as in training, its first k slots
        base = self.rows_logits(h)  # [k, Vd or V]
        prev = pending
        tokens, probs = [], []
        for j in range(k):
            m = self.markov_in.weight[prev]
            logits = base[j] + self.markov_out(m)
            t, q = self.draw_rows(logits[None], sampler)  # a target id, q [1, V] or None
            t, q = int(t[0]), None if q is None else q[0]
            tokens.append(t)
            probs.append(q)
            prev = t
        return proposal(tokens, probs)

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree at most B deep from one block pass: a node at depth d (the root, the pending token: 0)
        with token x gets its children from ``base[d] + W2(W1[x])``, the logits ``propose`` uses after x; set
        ``tree.min_prob`` for adaptive length."""
        tree = self.within_reach(tree)
        base = self.rows_logits(self._full_block(pending)[: tree.depth])  # [depth, Vd or V]: slot d predicts depth d+1

        def children_of(depth: int, tokens: torch.Tensor) -> torch.Tensor:  # target ids [n] at `depth` → [n, Vd or V]
            return base[depth] + self.markov_out(self.markov_in.weight[tokens.to(base.device)])

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            return children_of(int(node_depths(parents)[nodes[0]]), tokens[nodes])

        root = children_of(0, torch.tensor([pending]))[0]  # [V]
        return grow_tree(root, expand, tree, sampler, vocab=self.vocab())
