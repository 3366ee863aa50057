"""EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test", arXiv 2503.01840).

- ``fc``: Linear(n_taps·d_target → d, no bias) fuses the low/mid/high tap states.
- ``midlayer``: one decoder layer whose attention input is ``[RMSNorm(embed(token)); RMSNorm(hidden)]``
  (2d wide into q/k/v), residual from ``hidden``; SwiGLU MLP; then ``norm`` and ``lm_head`` over a
  reduced draft vocabulary (``d2t`` offsets: ``target_id = draft_id + d2t[draft_id]``; ``t2d`` boolean
  over the target vocabulary). The token embedding is copied from the target and frozen.
- Training-time test: unroll ``ttt_steps`` steps; step j feeds the draft's own pre-norm output of step
  j−1 as the hidden input, positions advance by one per step, and a query sees the step-0 keys causally
  plus its own position's key from each later step (:func:`models.layers.ttt_mask`).
- Loss: soft cross-entropy against the target's distribution restricted to the draft vocabulary, step
  weights ``step_decay**j``; positions whose target argmax is outside the draft vocabulary are masked.
  Optionally (``feature_weight`` > 0; EAGLE-3 itself has none) EAGLE-1's feature regression, smooth-L1 of step
  j's output at t onto the step-0 input at t+1+j (``fc`` over the taps there, detached), so that step j+1 reads
  what step 0 was trained on and drafted positions past the trained steps stay in distribution, as EAGLE-1's do
  (for EAGLE-1, :mod:`models.heads.eagle`, that input is the target's final-norm feature itself).

Alignment (``loss_mask`` convention of :mod:`data.chat`): at step j, position t holds hidden input for
position t and token ``input_ids[t+1+j]``, and learns the target's distribution at position t+1+j
(the next token, ``input_ids[t+2+j]``), weighted by ``loss_mask[t+2+j]``.
Module names follow SGLang/SpecForge (``fc``, ``midlayer``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).

Variants of vLLM's ``speculators`` trainer (its EAGLE-3 defaults; all off here unless set, so a head is imported
from a checkpoint trained by it faithfully): ``norm_before_fc`` — one RMSNorm (``input_norm``) over the concatenated
taps before ``fc``; ``norm_before_residual`` — the residual around attention starts from the normed hidden input
instead of the raw one; ``norm_output`` — each step's output is passed through ``norm`` before it is fed to the next
step (and ``lm_head`` reads it as it is); ``sliding_window`` — a query sees the step-0 keys of the last
``sliding_window`` positions only (its own included), the drafted keys as before. None of them measured a gain here
yet: they exist to read such checkpoints.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from data.errors import UserError
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Proposal, Sampler, proposal
from models.heads.trees import TreeSpec, ancestors, grow_tree, node_depths
from models.heads.vocab import build_draft_vocab, choose, draft_ids
from models.layers import (MLP, Attention, KVBuffer, RMSNorm, Rotary, attention_shape, copy_final_norm, feature_regression,
                           frozen_embedding, loss_weight, row_ce, shift_left, ttt_attention)
from models.target import rope_theta as target_rope_theta


def step_weights(loss_mask: torch.Tensor, in_vocab: torch.Tensor, valid: torch.Tensor, j: int) -> torch.Tensor:
    """Loss weight [B, T] of unroll step j: position t learns token t+2+j, so it counts where
    ``loss_mask[t+2+j]`` is set, that token is real (not padding), and the target's argmax at t+1+j is in
    the draft vocabulary."""
    return (shift_left(loss_mask, 2 + j) * shift_left(in_vocab.long(), 1 + j) * shift_left(valid, 2 + j)).float()


VARIANTS = ("norm_before_fc", "norm_before_residual", "norm_output", "sliding_window")  # speculators' options (docstring)


class Eagle3MidLayer(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv: int, head_dim: int, d_ff: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)    # on the token embedding
        self.hidden_norm = RMSNorm(d, eps)        # on the fused / previous hidden state
        self.self_attn = Attention(d, n_heads, n_kv, head_dim, d_in=2 * d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, d_ff)


class Eagle3Head(DraftHead):
    family = "eagle3"
    tap_method = "eagle3"
    needs_teacher_logits = True

    def __init__(self, target: Any, ttt_steps: int = 7, draft_vocab_size: int | None = 32000, step_decay: float = 0.8,
                 num_heads: int | None = None, num_kv_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float | None = None, rms_eps: float = 1e-6, freeze_lm_head: bool = False,
                 feature_weight: float = 0.0, norm_before_fc: bool = False, norm_before_residual: bool = False,
                 norm_output: bool = False, sliding_window: int | None = None):
        variants = {k: v for k, v in (("norm_before_fc", norm_before_fc), ("norm_before_residual", norm_before_residual),
                                      ("norm_output", norm_output), ("sliding_window", sliding_window)) if v}
        super().__init__(target, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size, step_decay=step_decay,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         rope_theta=rope_theta, rms_eps=rms_eps, freeze_lm_head=freeze_lm_head,
                         feature_weight=feature_weight,
                         **variants)  # recorded only when set: exports of the plain head stay as they were
        if ttt_steps < 1:
            raise UserError(f"draft.ttt_steps={ttt_steps}: must be >= 1")
        self.feature_weight = loss_weight(feature_weight, "draft.feature_weight")
        if sliding_window is not None and int(sliding_window) < 1:
            raise UserError(f"draft.sliding_window={sliding_window}: must be >= 1 (or null: full attention)")
        self.norm_before_residual, self.norm_output = bool(norm_before_residual), bool(norm_output)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        tc = target.config
        d, V = tc.hidden_size, tc.vocab_size
        n_taps = len(target.tap_layers)
        n_heads, n_kv, head_dim = attention_shape(tc, num_heads, num_kv_heads)
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.draft_vocab_size = min(draft_vocab_size or V, V)

        self.embed_tokens = frozen_embedding(target.embed_tokens().weight)  # [V, d]
        self.fc = nn.Linear(n_taps * d, d, bias=False)
        self.input_norm = RMSNorm(n_taps * d, rms_eps) if norm_before_fc else None  # over the concatenated taps
        self.midlayer = Eagle3MidLayer(d, n_heads, n_kv, head_dim, intermediate_size or tc.intermediate_size, rms_eps)
        self.norm = RMSNorm(d, rms_eps)
        copy_final_norm(self.norm, target)  # the draft's final norm feeds rows of the target's head: start from its norm
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.rotary = Rotary(head_dim, rope_theta or target_rope_theta(tc))
        d2t, t2d = build_draft_vocab(torch.ones(V), self.draft_vocab_size)  # identity-like until data is seen
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        # lm_head starts as the target's head restricted to the draft vocabulary (as speculators does); the rows are
        # chosen again when prepare_from_data fixes the vocabulary. A plain tensor reference: not a parameter/buffer.
        self.__dict__["_target_head"] = target.lm_head().weight.detach()  # [V, d]
        self.init_lm_head_from_target()
        self.lm_head.requires_grad_(not freeze_lm_head)

    @property
    def num_steps(self) -> int:
        return self.ttt_steps

    def decoder_layer(self) -> nn.Module:
        return self.midlayer

    def serving_dims(self) -> dict:
        return {"hidden_size": self.fc.out_features, "rms_norm_eps": self.norm.eps,
                "num_taps": self.fc.in_features // self.fc.out_features, "vocab_size": self.t2d.numel(),
                "draft_vocab_size": self.draft_vocab_size, "num_hidden_layers": 1}

    def prepare_from_data(self, token_counts: torch.Tensor) -> None:
        d2t, t2d = build_draft_vocab(token_counts, self.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.init_lm_head_from_target()

    def init_lm_head_from_target(self) -> None:
        """lm_head ← the target's lm_head rows of the draft vocabulary (a no-op on a head built from an export)."""
        w = self.__dict__.get("_target_head")
        if w is not None and w.shape == (self.t2d.numel(), self.lm_head.in_features):
            with torch.no_grad():
                self.lm_head.weight.copy_(w[self.draft_ids().to(w.device)].to(self.lm_head.weight))

    @property
    def vocab_state(self) -> tuple[str, ...]:
        """With a frozen ``lm_head`` (the floor's default) its rows are the target's rows of the draft vocabulary, so
        ``init_from=`` may give a trained head another vocabulary (``draft.draft_vocab_size``) with no training."""
        return () if self.lm_head.weight.requires_grad else ("d2t", "t2d", "lm_head.weight")

    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, [Vd]."""
        return draft_ids(self.d2t)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | range) -> tuple:
        """One draft step's projections. hidden [B, T, d], tokens [B, T], positions [B, T] (or a range of T, one
        row; of 1, one position for all T) → (q, k, v) [B, H, T, hd]."""
        emb = self.embed_tokens(tokens)
        x = torch.cat([self.midlayer.input_layernorm(emb), self.midlayer.hidden_norm(hidden)], dim=-1)  # [B, T, 2d]
        cos, sin = self.rotary(positions)
        return self.midlayer.self_attn.qkv(x, cos, sin)

    def fuse(self, feats: Any) -> torch.Tensor:
        """The hidden input of step 0 from the target's features: ``fc`` over the taps, [B, T, n_taps, d] → [B, T, d]."""
        x = feats.tap_states.flatten(-2).to(self.fc.weight.dtype)  # [B, T, n_taps·d]
        return self.fc(x if self.input_norm is None else self.input_norm(x))

    def feature_of(self, h: torch.Tensor) -> torch.Tensor:
        """What ``lm_head`` reads of a step's pre-norm output h [B, T, d]: the draft's final norm of it, in the
        place of the target's final-norm feature (``norm_output``: h is normed already)."""
        return h if self.norm_output else self.norm(h)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, T, Vd] of a step's pre-norm output h [B, T, d]."""
        return self.lm_head(self.feature_of(h))

    def step_loss(self, j: int, h: torch.Tensor, feats: Any, w: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
        """A loss of unroll step j beside the soft cross-entropy: ``feature_weight`` × smooth-L1 between step j's
        output at position t (what step j+1 reads) and the step-0 input at t+1+j (the position that predicts the same
        token), over the positions the token loss scores (``w`` [B, T]); ``x0``: the step-0 input [B, T, d] where the
        caller has it. EAGLE-3 has none (weight 0); EAGLE-1 regresses features."""
        if self.feature_weight == 0:
            return h.new_zeros(())
        f = shift_left((self.fuse(feats) if x0 is None else x0).detach(), 1 + j)  # [B, T, d]
        return self.feature_weight * feature_regression(h, f, w)

    def residual(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + MLP: the output [B, T, d] fed to the next step (pre-norm; ``norm_output``: normed)."""
        res = self.midlayer.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = res + self.midlayer.self_attn.out(attn_out)
        h = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
        return self.norm(h) if self.norm_output else h

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output [B, T, d], draft logits [B, T, Vd])."""
        h = self.residual(hidden, attn_out)
        return h, self.logits_of(h)

    def unroll(self, ids: torch.Tensor, valid: torch.Tensor, feats: Any, steps: int, hidden: torch.Tensor | None = None):
        """The training-time-test forward: yields step j's pre-norm output [B, T, d] for j < ``steps`` (its draft
        logits are ``logits_of`` of it); at step j position t reads token ``ids[t+1+j]`` and predicts token t+2+j
        (what decoding's chain computes with the drafts as the following tokens). ``hidden``: step 0's input
        (``fuse(feats)``) where the caller has computed it."""
        B, T = ids.shape
        hidden = self.fuse(feats) if hidden is None else hidden  # [B, T, d]
        base_pos = torch.arange(T, device=ids.device).expand(B, T)
        keys, values = [], []
        for j in range(steps):
            q, k, v = self.step(hidden, shift_left(ids, 1 + j), base_pos + j)
            keys.append(k)
            values.append(v)
            hidden = self.residual(hidden, self.attend(q, keys, values, valid))
            yield hidden

    def attend(self, q: torch.Tensor, keys: list, values: list, valid: torch.Tensor) -> torch.Tensor:
        """Training-time-test attention (q [B, H, T, hd], one key/value list entry per step so far) → [B, H, T, hd];
        with ``sliding_window`` the step-0 keys further back than the window are hidden, where T makes it bind."""
        W, T = self.sliding_window, q.shape[2]
        if W is None or T <= W:
            return ttt_attention(q, keys, values, key_valid=valid)
        idx = torch.arange(T, device=q.device)
        near = (idx[:, None] - idx[None, :] < W) & (idx[:, None] >= idx[None, :])  # [T, T] causal, inside the window
        s0 = (q @ keys[0].transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, T, T]
        s0 = s0.masked_fill(~(near & valid[:, None, None, :].bool()), torch.finfo(s0.dtype).min)
        diag = [(q * k).sum(-1, keepdim=True) / math.sqrt(q.shape[-1]) for k in keys[1:]]  # j × [B, H, T, 1]
        p = torch.softmax(torch.cat([s0] + diag, dim=-1).float(), dim=-1).to(q.dtype)
        out = p[..., :T] @ values[0]
        for i, v in enumerate(values[1:]):
            out = out + p[..., T + i: T + i + 1] * v
        return out

    def window_start(self, n_ctx: int) -> int:
        """The first context key a query at the last of ``n_ctx`` context positions sees (``sliding_window``)."""
        return 0 if self.sliding_window is None else max(0, n_ctx - self.sliding_window)

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        """[steps, V] logits over the target vocabulary (−inf outside the draft vocabulary) of the training
        forward at position ``at`` (see :meth:`DraftHead.teacher_forced_logits`)."""
        out = torch.full((steps, self.t2d.numel()), float("-inf"), device=ids.device)
        for j, h in enumerate(self.unroll(ids, torch.ones_like(ids), feats, steps)):
            out[j, self.draft_ids()] = self.logits_of(h[0, at]).float()
        return out

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        B, T = ids.shape
        t_logits = feats.all_logits()  # [B, T, V] target logits
        t_top = t_logits.argmax(-1)  # [B, T]
        t_draft = t_logits[..., self.draft_ids()].float()  # [B, T, Vd]
        t_probs = torch.softmax(t_draft, dim=-1)  # [B, T, Vd] on the draft vocabulary
        mass = None  # [B·T] the target's mass on the draft vocabulary (for the T=1 acceptance), where it is not all
        if self.draft_vocab_size < t_logits.shape[-1]:
            mass = (torch.logsumexp(t_draft, -1) - torch.logsumexp(t_logits.float(), -1)).exp().view(-1)
        in_vocab = self.t2d[t_top]  # [B, T]
        loss = t_probs.new_zeros(())
        correct = torch.zeros(self.ttt_steps, device=ids.device)
        total = torch.zeros(self.ttt_steps, device=ids.device)
        accepted = torch.zeros(self.ttt_steps, device=ids.device)
        x0 = self.fuse(feats)  # [B, T, d] step 0's input, also the feature regression's reference
        for j, h in enumerate(self.unroll(ids, valid, feats, self.ttt_steps, x0)):
            w = step_weights(loss_mask, in_vocab, valid, j)  # [B, T]
            b, t = w.nonzero(as_tuple=True)  # the N scored positions: only they are projected onto the vocabulary
            logits = self.logits_of(h[b, t])  # [N, Vd]
            wn = w[b, t]
            ce, tvd = row_ce(logits, teacher=t_probs.view(B * T, -1), rows=b * T + t + 1 + j, teacher_is_probs=True,
                             return_tv=True, mass=mass)  # [N], [N]
            loss = loss + (self.step_decay ** j) * ((ce * wn).sum() / wn.sum().clamp_min(1.0) + self.step_loss(j, h, feats, w, x0))
            with torch.no_grad():
                top = logits.argmax(-1)
                correct[j], total[j] = (top + self.d2t[top] == t_top[b, t + 1 + j]).sum(), b.numel()  # target ids
                accepted[j] = (1 - tvd).sum()  # Σ min(p, q) against the target's full distribution
        return HeadOutput(loss=loss, correct=correct, total=total, accepted=accepted)

    # -- inference (the decoder's Drafter protocol) ----------------------------------------------
    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        """After prefill: the prompt's tap states become pending context (each still needs its next token)."""
        self._ctx = KVBuffer()  # step-0 keys/values of processed context [1, H, Tc, hd]
        self._pos = 0
        self._pending_h = self.fuse(feats)  # [1, m, d]
        self._pending_next = prompt_ids.view(-1)[1:]  # next token of each pending position but the last

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        """Accepted tokens ``[x, d_1..d_n]`` and their target features become pending context. After a round this
        head did not draft (no ``propose`` since the last commit), they join the pending positions still there:
        ``x`` is the next token of the last of them."""
        h, tokens = self.fuse(feats), tokens.view(-1).to(self._pending_next.device)
        if self._pending_h.shape[1]:
            self._pending_h = torch.cat([self._pending_h, h], 1)
            self._pending_next = torch.cat([self._pending_next, tokens])
        else:
            self._pending_h, self._pending_next = h, tokens[1:]

    @torch.no_grad()
    def _extend(self, pending: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 of every proposal: extend the context with the pending positions (their keys and values; the
        last one reads ``pending``). Returns the last position's pre-norm output [1, 1, d] and draft logits [Vd]."""
        nxt = torch.cat([self._pending_next, torch.tensor([pending], device=self._pending_next.device)])[None]  # [1, m]
        h = self._pending_h
        m = h.shape[1]
        q, k_, v_ = self.step(h, nxt, range(self._pos, self._pos + m))
        keys, values = self._ctx.add(k_, v_)
        self._ctx.keep()
        # Every pending row's key/value is cached, but only the last row's output is used: the last query sees
        # the whole context (no mask), and the MLP and the draft lm_head run on one row, not m.
        w0 = self.window_start(keys.shape[2])
        o = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], keys[:, :, w0:], values[:, :, w0:])  # [1, H, 1, hd]
        h_out, logits = self.finish(h[:, -1:], o)  # [1, 1, d], [1, 1, Vd]
        self._pos += m
        self._pending_h, self._pending_next = h[:, :0], self._pending_next[:0]
        return h_out, logits[0, -1]

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        # 1) extend the context with the pending positions
        last_h, last_logits = self._extend(pending)
        dev = last_h.device
        # 2) chain: feed the draft's own pre-norm output and drafted token, positions advancing
        tokens, probs = [], []
        for j in range(k):
            t, qv = choose(last_logits, self.d2t, self.t2d.numel(), sampler)
            tokens.append(t)
            probs.append(qv)
            if j == k - 1:
                break
            q, k1, v1 = self.step(last_h, torch.tensor([[t]], device=dev), range(self._pos + j, self._pos + j + 1))
            ks, vs = self._ctx.add(k1, v1)  # the context, then this round's drafts
            w0 = self.window_start(self._ctx.n)
            o = torch.nn.functional.scaled_dot_product_attention(q, ks[:, :, w0:], vs[:, :, w0:])
            last_h, lg = self.finish(last_h, o)
            last_logits = lg[0, -1]
        self._ctx.keep(0)  # drafted positions are not context
        return proposal(tokens, probs)

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree (:func:`models.heads.trees.grow_tree`, EAGLE-2 style): one draft forward per level.

        A node at depth j reads its parent's pre-norm output (depth 1: the last context position's), its own token
        and position ``_pos + j − 1`` (a chain's step j−1), and attends to the context and to its ancestors and
        itself. Node keys live only in this call: the context cache holds the committed positions alone."""
        last_h, last_logits = self._extend(pending)  # [1, 1, d], [Vd]
        dev = last_h.device
        P = self._ctx.n  # context keys; the expanded nodes' keys are added after them, in the order of ``done``
        done: list[int] = []  # expanded nodes, in the order of the rows below
        hs = last_h[0, :0]  # [N, d] their pre-norm outputs

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            nonlocal hs
            m, depth = len(nodes), int(node_depths(parents)[nodes[0]])
            row = {nd: i for i, nd in enumerate(done)}
            par = parents[nodes].tolist()
            hid = torch.stack([hs[row[p]] if p >= 0 else last_h[0, 0] for p in par])[None]  # [1, m, d]
            p = self._pos + depth - 1  # every node of this level sits at position p: one row of cos/sin, broadcast
            q, k, v = self.step(hid, tokens[nodes].to(dev)[None], range(p, p + 1))  # [1, H, m, hd]
            done.extend(nodes)
            keys, values = self._ctx.add(k, v)  # [1, H, P+N, hd]
            sees = ancestors(parents)[nodes][:, done].to(dev)  # [m, N]: ancestors and itself among the keyed nodes
            mask = torch.cat([torch.ones(m, P, dtype=torch.bool, device=dev), sees], 1)  # [m, P+N]
            mask[:, : self.window_start(P)] = False  # sliding_window: context keys out of reach
            o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            h, logits = self.finish(hid, o)  # [1, m, d], [1, m, Vd]
            hs = torch.cat([hs, h[0]])
            return logits[0]  # [m, Vd]: grow_tree maps draft ids to target ids

        prop = grow_tree(last_logits, expand, tree, sampler, vocab=(self.draft_ids(), self.t2d.numel()))
        self._ctx.keep(0)  # node keys live only in this call
        return prop
