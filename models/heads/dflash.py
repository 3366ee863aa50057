"""DFlash block-diffusion drafter (Chen, Liang, Liu, "DFlash", arXiv 2602.06036): one forward drafts a block.

- Context: ``RMSNorm(fc([tap states]))`` of every committed token (taps spread over the target's depth).
- Draft: ``num_layers`` target-shaped decoder layers over the block ``[anchor, MASK×(B−1)]`` at positions
  anchor..anchor+B−1, reusing the target's frozen embedding and ``lm_head`` (with a trainable final norm).
  In every layer the queries come from the block only, and keys/values are
  ``[k_proj(context); k_proj(block)]`` with the same projections (target features injected into K/V);
  inside the block attention is bidirectional.
- Training: per sequence up to ``num_anchors`` random anchors a with ``loss_mask[a]`` and ``loss_mask[a+1]``
  set, packed into one pass; a block sees context rows strictly before its anchor and its own block,
  never another block (:func:`block_mask`). Slot k (1..B−1) is labelled with token a+k, the anchor slot is
  not trained; CE on the data token weighted ``exp(−(k−1)/γ)``.
- ``draft_vocab_size``: the drafted tokens come from the most frequent training tokens only (``d2t``/``t2d`` as
  EAGLE-3's, :class:`models.heads.vocab.FrozenRows`): the loss and decoding read those rows of the frozen head (a
  slot whose label is outside them is not scored), so a training step projects onto Vd rows instead of V.
- ``anchor_slot=True``: the first draft token is predicted from the anchor's own slot (DeepSpec's DFlash baseline,
  as DSpark does): slot k (0..B−1) is labelled with token a+1+k, weighted ``exp(−k/γ)``, so a block drafts B tokens.
- ``soft=True``: the cross-entropy is against the target's distribution for the slot's token (renormalised on the
  draft vocabulary) instead of the data's token, as speculators' DFlash trainer and our EAGLE-3 score; on ShareGPT's
  own answers (eval.peer's DFlash settings, 200 steps) it drafted 2–8% further at T=0 and T=1 on every set.
- Decoding: the context K/V of committed tokens is cached per layer and extended after each round; one
  forward per round proposes up to B−1 tokens (B with ``anchor_slot``; the decoder then verifies them like any
  draft), or a tree as deep whose nodes at one depth all take their children from the same slot (the block does not
  see the drafts).
Decoding always runs the whole trained block and keeps the first k slots (attention inside a block is
bidirectional: a shorter block of MASKs is another input). Train with the largest block you decode with.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from data.errors import UserError
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Proposal, Sampler
from models.heads.trees import TreeSpec, grow_tree, node_depths
from models.heads.vocab import FrozenRows
from models.layers import (MLP, Attention, KVBuffer, RMSNorm, Rotary, attention_shape, copy_final_norm, frozen_embedding, frozen_linear,
                           row_ce)
from models.target import rope_theta


class DFlashLayer(nn.Module):
    """A target-shaped decoder layer whose attention also reads the (already normalised) context rows."""

    def __init__(self, d: int, n_heads: int, n_kv: int, head_dim: int, d_ff: int, eps: float, qk_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(d, n_heads, n_kv, head_dim, qk_norm=qk_norm, eps=eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, d_ff)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, Tc, d] → k, v [B, H, Tc, hd] (the block's own k/v projections, rotary at context positions)."""
        return self.self_attn.kv(ctx, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Tb, d] block hidden; ctx_k/v [B, H, Tc, hd]; mask [B, 1, Tb, Tc+Tb] or None (see all)."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        o = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), attn_mask=mask)
        x = x + self.self_attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(anchors: torch.Tensor, anchor_ok: torch.Tensor, T: int, block: int) -> torch.Tensor:
    """Attention mask of packed blocks. anchors, anchor_ok [B, N] → bool [B, 1, N·blk, T + N·blk].

    Block n sees context rows j < anchors[n] and every slot of its own block, nothing else (a padded
    anchor sees only its own block, so no row is empty)."""
    Bt, N = anchors.shape
    j = torch.arange(T, device=anchors.device)
    ctx = (j[None, None, :] < anchors[:, :, None]) & anchor_ok[:, :, None].bool()  # [B, N, T]
    ctx = ctx[:, :, None, :].expand(Bt, N, block, T).reshape(Bt, N * block, T)
    blk_id = torch.arange(N * block, device=anchors.device) // block
    own = (blk_id[:, None] == blk_id[None, :]).expand(Bt, -1, -1)  # [B, N·blk, N·blk]
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_targets(ids: torch.Tensor, loss_mask: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor,
                  ok: torch.Tensor, blk: int, gamma: float, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot positions, labels and loss weights of packed blocks, each [B, N, blk].

    Slot k of the block anchored at a sits at position a+k and is labelled with token a+k+shift. DFlash
    (shift 0): the anchor slot is not trained and slot k≥1 weighs ``exp(−(k−1)/γ)``; the anchor-slot layout
    (shift 1: DSpark, DFlash ``anchor_slot``): every slot predicts the next token, weighing ``exp(−k/γ)``. Only real tokens in the loss mask count."""
    Bt, T = ids.shape
    N = anchors.shape[1]
    k = torch.arange(blk, device=ids.device)
    pos = anchors[:, :, None] + k  # [B, N, blk]
    tgt = (pos + shift).clamp(max=T - 1).flatten(1)
    labels = ids.gather(1, tgt).view(Bt, N, blk)
    w = (loss_mask.gather(1, tgt) * valid.gather(1, tgt)).view(Bt, N, blk).float()
    step = (k + shift).float()
    w = w * (pos + shift < T) * ok[:, :, None] * (step >= 1) * torch.exp(-(step - 1) / gamma)
    return pos, labels, w


class DFlashHead(FrozenRows, DraftHead):
    family = "dflash"
    tap_method = "dflash"
    needs_teacher_logits = True  # accuracy against the target's own top-1

    def __init__(self, target: Any, block_size: int = 8, num_layers: int = 2, num_anchors: int = 64,
                 gamma: float | None = None, mask_token_id: int | None = None, rms_eps: float = 1e-6,
                 qk_norm: bool = False, anchor_slot: bool = False, draft_vocab_size: int | None = None,
                 soft: bool = False):
        super().__init__(target, block_size=block_size, num_layers=num_layers, num_anchors=num_anchors, gamma=gamma,
                         mask_token_id=mask_token_id, rms_eps=rms_eps, qk_norm=qk_norm)
        if anchor_slot:
            self.init_args["anchor_slot"] = True  # only when set: exports without it load as z-lab's MASK-slot layout
        if draft_vocab_size is not None:
            self.init_args["draft_vocab_size"] = draft_vocab_size
        if soft:
            self.init_args["soft"] = True
        self.soft = soft
        self.first_slot = 0 if anchor_slot else 1  # the slot that predicts the pending token's successor
        tc = target.config
        if block_size < 2:
            raise UserError(f"draft.block_size={block_size}: must be >= 2 (the anchor and at least one drafted token)")
        mask_id = mask_token_id if mask_token_id is not None else getattr(tc, "mask_token_id", None)
        if mask_id is None or not 0 <= int(mask_id) < tc.vocab_size:
            raise UserError(f"draft.mask_token_id={mask_id}: give the id of a token reserved as MASK "
                            f"(the embedded target has <|mask|>; for other targets pick an unused special token)")
        d = tc.hidden_size
        n_heads, n_kv, head_dim = attention_shape(tc)
        self.block_size, self.num_anchors, self.mask_token_id = block_size, num_anchors, int(mask_id)
        self.gamma = gamma if gamma is not None else {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)
        n_taps = len(target.tap_layers)
        self.fc = nn.Linear(n_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, rms_eps)
        self.layers = nn.ModuleList([DFlashLayer(d, n_heads, n_kv, head_dim, tc.intermediate_size, rms_eps, qk_norm)
                                     for _ in range(num_layers)])
        self.norm = RMSNorm(d, rms_eps)
        copy_final_norm(self.norm, target)  # feeds the target's frozen head: start from the target's final norm
        self.rotary = Rotary(head_dim, rope_theta(tc))
        self.embed_tokens = frozen_embedding(target.embed_tokens().weight)  # [V, d]
        self.lm_head = frozen_linear(target.lm_head().weight)              # d → V
        self.init_draft_rows(draft_vocab_size)  # draft_head: the frozen head's rows of the draft vocabulary

    @property
    def num_steps(self) -> int:
        return self.block_size - self.first_slot

    @property
    def max_draft(self) -> int:
        return self.block_size - self.first_slot  # z-lab's anchor slot holds the pending token and predicts nothing

    def decoder_layer(self) -> nn.Module:
        return self.layers[0]

    def serving_dims(self) -> dict:
        return {"hidden_size": self.fc.out_features, "rms_norm_eps": self.norm.eps,
                "num_taps": self.fc.in_features // self.fc.out_features, "vocab_size": self.lm_head.out_features,
                "num_hidden_layers": len(self.layers)}

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n, d_t] → context rows [B, T, d]."""
        return self.hidden_norm(self.fc(taps.flatten(-2).to(self.fc.weight.dtype)))

    def run_block(self, block_ids: torch.Tensor, block_pos: torch.Tensor | range, ctx_kv: list,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """block_ids, block_pos [B, Tb] (or a range of Tb, one block); ctx_kv: per layer (k, v) → final hidden [B, Tb, d]."""
        x = self.embed_tokens(block_ids)
        cos, sin = self.rotary(block_pos)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask)
        return self.norm(x)

    def sample_anchors(self, loss_mask: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``num_anchors`` random anchors per row where a and a+1 are both in the loss mask → [B, N] ids, ok."""
        ok = (loss_mask.bool() & valid.bool())
        cand = ok & torch.cat([ok[:, 1:], torch.zeros_like(ok[:, :1])], 1)  # [B, T]
        score = torch.rand(cand.shape, device=cand.device).masked_fill(~cand, -1.0)
        N = min(self.num_anchors, cand.shape[1])
        top, idx = score.topk(N, dim=1)
        return idx, top >= 0

    def block_hidden(self, ids: torch.Tensor, anchors: torch.Tensor, ok: torch.Tensor, tap_states: torch.Tensor) -> torch.Tensor:
        """Final hidden state [B, N, blk, d] of the packed blocks ``[ids[a], MASK, ...]`` at positions a..a+blk−1."""
        Bt, T = ids.shape
        N, blk = anchors.shape[1], self.block_size
        pos = anchors[:, :, None] + torch.arange(blk, device=ids.device)  # [B, N, blk]
        block_ids = torch.full_like(pos, self.mask_token_id)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        ctx = self.context(tap_states)  # [B, T, d]
        cos, sin = self.rotary(torch.arange(T, device=ids.device).expand(Bt, T))
        ctx_kv = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
        h = self.run_block(block_ids.flatten(1), pos.flatten(1), ctx_kv, block_mask(anchors, ok, T, blk))
        return h.view(Bt, N, blk, -1)

    def anchored_hidden(self, ids: torch.Tensor, feats: Any, at: int) -> torch.Tensor:
        """The training forward of one block anchored at the pending position ``at+1`` → final hidden [blk, d]."""
        anchors = torch.tensor([[at + 1]], device=ids.device)
        return self.block_hidden(ids, anchors, torch.ones_like(anchors, dtype=torch.bool), feats.tap_states)[0, 0]

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        first = self.first_slot  # slot first+j predicts token at+2+j
        return self.on_draft_vocab(self.lm_head(self.anchored_hidden(ids, feats, at))[first: first + steps].float())

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        T = ids.shape[1]
        anchors, ok = self.sample_anchors(loss_mask, valid)  # [B, N]
        shift = 1 - self.first_slot  # slot k is labelled with token a+k+shift
        pos, labels, w = block_targets(ids, loss_mask, valid, anchors, ok, self.block_size, self.gamma, shift)  # [B, N, blk]
        h = self.block_hidden(ids, anchors, ok, feats.tap_states)  # [B, N, blk, d]
        before = (pos + shift - 1).clamp(min=0, max=T - 1)  # [B, N, blk]: the position that predicts each slot's token
        rows = (w > 0).nonzero(as_tuple=True)  # the M scored slots: only they are projected onto the vocabulary
        z = self.rows_logits(h[rows]).float()  # [M, Vd] (or [M, V])
        b, at = rows[0], before[rows]  # [M] each
        t, inv = feats.logits_at(b, at)  # [U, V] the target's at the distinct predicting positions, [M] into them
        t_top = t.argmax(-1)  # [U] the target's top-1 for each slot's token
        if self.soft:  # the target's distribution for the slot's token, renormalised on the head's vocabulary
            t = t[:, self.draft_ids()] if self.draft_vocab_size else t  # [U, Vd]: the columns first, then the cast
            ce, keep = row_ce(z, teacher=t.float()[inv]), 1.0  # [M]
        else:
            lab, keep = self.draft_labels(labels[rows])  # [M] columns of z; keep: the label is draftable
            ce = row_ce(z, labels=lab)  # [M]
        loss = (ce * w[rows] * keep).sum() / float(max(b.numel(), 1))
        with torch.no_grad():
            slot, first = rows[2], self.first_slot  # [M]; without anchor_slot slot 0 is never scored
            blk = w.shape[-1]
            hit = (self.column_ids(z.argmax(-1)) == t_top[inv]).float()
            correct = torch.bincount(slot, weights=hit, minlength=blk)[first:].float()
            total = torch.bincount(slot, minlength=blk)[first:].float()
        return HeadOutput(loss=loss, correct=correct, total=total)

    # -- inference ------------------------------------------------------------------------------
    def _extend(self, taps: torch.Tensor) -> None:
        ctx = self.context(taps)  # [1, m, d]
        m = ctx.shape[1]
        cos, sin = self.rotary(range(self._n, self._n + m))
        for layer, cache in zip(self.layers, self._kv):
            cache.add(*layer.context_kv(ctx, cos, sin))
            cache.keep()
        self._n += m

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        self.reselect_if_stale()
        self._kv, self._n = [KVBuffer() for _ in self.layers], 0  # each layer's context keys/values
        self._extend(feats.tap_states)

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        self._extend(feats.tap_states)

    def _full_block(self, pending: int) -> torch.Tensor:
        """Final hidden [block_size, d] of ``[pending, MASK×(B−1)]`` after the committed context: always the whole
        block, as in training (attention inside a block is bidirectional, so a shorter block of MASKs is another
        input and gives other states); a draft of k tokens keeps the first k slots."""
        dev = self.fc.weight.device
        block = torch.full((1, self.block_size), self.mask_token_id, device=dev)
        block[0, 0] = pending
        return self.run_block(block, range(self._n, self._n + self.block_size), [c.kept() for c in self._kv], None)[0]

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        k, first = min(k, self.max_draft), self.first_slot
        logits = self.rows_logits(self._full_block(pending)[first: first + k])  # [k, Vd or V]
        tokens, q = self.draw_rows(logits, sampler)  # [k] target ids, [k, V] or None
        return Proposal(tokens, q)

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree ``max_draft`` deep from one block pass: the slot that drafts depth d+1 in ``propose`` gives
        the children of every node at depth d."""
        tree, first = self.within_reach(tree), self.first_slot
        logits = self.rows_logits(self._full_block(pending)[first: first + tree.depth])  # [depth, Vd or V]: depth d+1 at row d

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            depth = int(node_depths(parents)[nodes[0]])  # all nodes of a call share one depth
            return logits[depth].expand(len(nodes), -1)  # [len(nodes), Vd or V]

        return grow_tree(logits[0], expand, tree, sampler, vocab=self.vocab())
