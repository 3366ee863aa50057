"""Multi-token prediction head (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, §2.2).

D sequential modules on the target's last hidden state. Module k (1-based) at position t reads the previous
depth's hidden state ``h^{k-1}_t`` (depth 0: the target's final-norm output) and the embedding of the next
*known* token ``t_{t+k}``:

    h'^k_t = eh_proj([enorm(Emb(t_{t+k})); hnorm(h^{k-1}_t)])        # 2d → d
    h^k    = DecoderLayer(h'^k)                                       # causal over positions, like the target
    P^k_t  = lm_head(norm_k(h^k_t))                                   # predicts token t+k+1

What is unusual compared with Medusa (parallel heads on one state) and EAGLE-3 (one layer unrolled):
- the modules are *different* layers chained in depth, each keeping the causal chain over the sequence:
  module k's block attends to its own depth-k states at earlier positions, so at decoding time every
  module keeps its own KV cache of the context;
- training is fully teacher-forced (module k sees the real token t+k and the real depth-(k−1) chain), so
  one pass over the batch trains all depths; no training-time test;
- the token embedding and output head are the target's own, shared and frozen (here: frozen copies, as in
  DFlash); each module has its own final norm (``shared_head.norm`` in DeepSeek's code), initialised from
  the target's final norm so an untrained module already produces logits on the target's scale.
The paper writes ``[RMSNorm(h); RMSNorm(Emb)]``; the reference code concatenates the embedding first
(``eh_proj(cat(enorm(e), hnorm(h)))``). We follow the code and its module names (``enorm``, ``hnorm``,
``eh_proj``) so published MTP weights map one to one; for a projection trained here the order is immaterial.

Loss: ``Σ_k w_k · CE_k`` over the loss-masked data tokens (``soft=true``: against the target's distribution);
DeepSeek-V3 weighs depths equally (λ/D); the default here is ``0.8**k`` as for the other heads in this
repository (a later depth only counts if the earlier ones were accepted). Per-step accuracy is measured
against the target's own top-1, so ``val/acc_len`` predicts greedy decoding.

Decoding: module 1 proposes d_1 from the target's state at the last position and the pending token; module
k proposes d_k from module k−1's states and the embeddings of the tokens d_1..d_{k−1} (teacher forcing with
the drafts). Only positions whose inputs are all known (committed or the pending token) enter a module's
cache; the drafted positions are recomputed every round, so nothing speculative needs to be cropped.
``draft_vocab_size``: draft from the most frequent target tokens only (chosen from the training data, stored as
``d2t``/``t2d`` like EAGLE-3's, :mod:`models.heads.vocab`). The head is the target's own and frozen, so this changes
decoding alone: logits on the kept rows are exactly the full head's, and one drafted token reads Vd rows of the head
instead of V (on the embedded target the full head was two thirds of a drafted token's multiply-adds). Training and
its accuracies stay over the full vocabulary; serving formats drop the vocabulary (vLLM drafts from the full head).
``reuse_last_module``: propose more than D tokens by applying the last module at deeper depths (untrained
extrapolation, each extra depth with its own cache); off by default.
``feature_weight`` (default 0; neither DeepSeek-V3 nor speculators has it): EAGLE-1's feature regression beside the
token loss, each depth's output at t (what the next depth reads) onto the depth-0 input at the position that predicts
the same token (the target's final-norm feature at t+k). Every depth then hands on a state in the space the first
module reads, so ``reuse_last_module`` applies the last module to inputs like those it was trained on.

Two layouts, one class (the defaults are DeepSeek-V3's; ``conf/draft/mtp_speculators.yaml`` sets the other):

    option           DeepSeek-V3 (default)               speculators 0.9.0 / vLLM (Qwen3-Next-style MTP)
    shared_module    D modules, module k at depth k      one module applied at all D depths
    qk_norm          Llama block                         Qwen3 block: per-head RMSNorm of q and k before RoPE
    chain_normed     next depth reads the pre-norm h^k   next depth reads norm_k(h^k), the state the head reads

Both concatenate ``[enorm(emb); hnorm(h)]``, start from the target's final-norm output, use the target's frozen
embedding and head, and keep each depth's own causal chain over the sequence (one KV cache per depth, also when
the weights are shared). Names map one to one: enorm/hnorm/eh_proj/norm = token_layernorm/hidden_layernorm/
input_proj/final_layernorm (:mod:`models.formats`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from data.errors import UserError
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Proposal, Sampler, proposal
from models.heads.trees import TreeSpec, grow_tree, node_depths, path_to
from models.heads.vocab import FrozenRows
from models.layers import (Attention, DecoderLayer, KVBuffer, RMSNorm, Rotary, attention_shape, copy_final_norm,
                           feature_regression, frozen_embedding, frozen_linear, lookahead_loss, loss_weight, shift_left)
from models.target import rope_theta


class MTPModule(nn.Module):
    """One MTP depth: ``eh_proj([enorm(emb); hnorm(h_prev)])`` → one pre-norm decoder block; ``norm`` feeds the head
    (and, with ``norm_output``, also the next depth: the module then returns its normed output)."""

    def __init__(self, d: int, n_heads: int, n_kv: int, head_dim: int, d_ff: int, eps: float,
                 qk_norm: bool = False, norm_output: bool = False):
        super().__init__()
        self.enorm = RMSNorm(d, eps)          # on the embedding of token t+k
        self.hnorm = RMSNorm(d, eps)          # on the previous depth's hidden state at t
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = DecoderLayer(d, n_heads, n_kv, d_ff, head_dim, eps)
        if qk_norm:  # a Qwen3 block: the same layer with per-head q/k RMSNorm in its attention
            self.block.self_attn = Attention(d, n_heads, n_kv, head_dim, qk_norm=True, eps=eps)
        self.norm = RMSNorm(d, eps)           # before the frozen output head
        self.norm_output = norm_output

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: KVBuffer | None = None, mask: torch.Tensor | None = None,
                tail: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """h_prev, emb [B, m, d] at m consecutive positions; past: the keys of the P positions before them, to which
        these positions' keys are added (the caller keeps what it wants of them; None: training, plain causal over
        the m positions); ``mask`` bool [m, P+m] (with past; default: causal after all past keys; a draft tree packs
        several paths' rows into one block); ``tail`` (with past, default mask): only the last ``tail`` rows' outputs
        are wanted, so the others are only keyed (the deepest depth of a round, whose other rows no depth reads).
        Returns the output [B, m (or tail), d] handed to the next depth (pre-norm, or normed with ``norm_output``) and
        these positions' k, v [B, H, m, hd] (None in training)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))  # [B, m, d]
        k = v = None
        if past is None:
            x = self.block(x, cos, sin)  # causal over the m positions
        else:
            x, k, v = self.block.cached(x, cos, sin, past, mask, tail)
        return (self.norm(x) if self.norm_output else x), k, v

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """This module's output → what the output head reads (its final norm, unless already applied)."""
        return h if self.norm_output else self.norm(h)


class MTPHead(FrozenRows, DraftHead):
    """``num_modules`` depths D; ``shared_module``: one module at every depth; ``qk_norm``: Qwen3 blocks;
    ``chain_normed``: each depth hands on its final-norm output (see the layouts table above)."""

    family = "mtp"
    reads_taps = False  # each depth starts from the final-norm feature
    needs_teacher_logits = True  # accuracy against the target's own top-1 (and soft targets)
    decode_only_state = ("d2t", "t2d", "draft_head.weight")  # the draft vocabulary (vLLM drafts from the full head)
    decode_settings = ("reuse_last_module",)

    def __init__(self, target: Any, num_modules: int = 3, loss_weights: list[float] | None = None, soft: bool = False,
                 reuse_last_module: bool = False, rms_eps: float = 1e-6, shared_module: bool = False,
                 qk_norm: bool = False, chain_normed: bool = False, draft_vocab_size: int | None = None,
                 feature_weight: float = 0.0):
        super().__init__(target, num_modules=num_modules, loss_weights=loss_weights, soft=soft,
                         reuse_last_module=reuse_last_module, rms_eps=rms_eps, shared_module=shared_module,
                         qk_norm=qk_norm, chain_normed=chain_normed, draft_vocab_size=draft_vocab_size,
                         feature_weight=feature_weight)
        if num_modules < 1:
            raise UserError(f"draft.num_modules={num_modules}: must be >= 1")
        self.feature_weight = loss_weight(feature_weight, "draft.feature_weight")
        weights = [0.8 ** k for k in range(num_modules)] if loss_weights is None else [float(w) for w in loss_weights]
        if len(weights) != num_modules or min(weights) < 0 or sum(weights) <= 0:
            raise UserError(f"draft.loss_weights={loss_weights}: give {num_modules} non-negative weights "
                            f"(one per module, not all zero), or null for 0.8**k")
        tc = target.config
        d = tc.hidden_size
        n_heads, n_kv, head_dim = attention_shape(tc)
        theta = rope_theta(tc)
        self.loss_weights, self.soft, self.reuse_last_module = weights, soft, reuse_last_module
        self.depths = num_modules  # D: depths trained and proposed (with shared_module, all by one module)
        self.layers = nn.ModuleList([MTPModule(d, n_heads, n_kv, head_dim, tc.intermediate_size, rms_eps, qk_norm, chain_normed)
                                     for _ in range(1 if shared_module else num_modules)])
        self.rotary = Rotary(head_dim, theta)
        for m in self.layers:  # each depth's final norm starts as the target's (logits on the target's scale)
            copy_final_norm(m.norm, target)
        self.embed_tokens = frozen_embedding(target.embed_tokens().weight)  # [V, d]
        self.lm_head = frozen_linear(target.lm_head().weight)              # d → V
        self.init_draft_rows(draft_vocab_size)  # decoding reads draft_head: the lm_head rows of the draft vocabulary

    @property
    def num_steps(self) -> int:
        return self.depths

    @property
    def max_draft(self) -> int | None:
        return None if self.reuse_last_module else self.num_steps  # one module per depth

    def decoder_layer(self) -> nn.Module:
        return self.layers[0].block

    def serving_dims(self) -> dict:
        m = self.layers[0]
        return {"hidden_size": m.eh_proj.out_features, "rms_norm_eps": m.norm.eps, "vocab_size": self.lm_head.out_features,
                "num_modules": len(self.layers), "chain_normed": m.norm_output}

    def module(self, depth: int) -> MTPModule:
        """Weights used at depth ``depth`` (1-based): module ``depth``, or the last one beyond D (the only one
        with ``shared_module``)."""
        return self.layers[min(depth, len(self.layers)) - 1]

    @property
    def eh_dtype(self) -> torch.dtype:
        return self.layers[0].eh_proj.weight.dtype

    def logits(self, depth: int, h: torch.Tensor) -> torch.Tensor:
        """Depth-``depth`` output [..., d] → logits [..., V] through the module's norm and the frozen head."""
        return self.lm_head(self.module(depth).head_input(h))

    def draft_logits(self, depth: int, h: torch.Tensor) -> torch.Tensor:
        """Decoding's logits: depth-``depth`` states [m, d] → [m, Vd] over the draft vocabulary's columns
        (:meth:`vocab`) through the draft rows alone, or [m, V] without one."""
        return self.rows_logits(self.module(depth).head_input(h))

    def depth_states(self, ids: torch.Tensor, last_state: torch.Tensor, steps: int):
        """The teacher-forced training forward: yields depth j+1's output states [B, T, d] for j < ``steps``
        (position t reads token t+1+j, predicts t+2+j through ``logits(j + 1, ·)``)."""
        B, T = ids.shape
        cos, sin = self.rotary(torch.arange(T, device=ids.device).expand(B, T))
        h = last_state.to(self.eh_dtype)  # [B, T, d] depth 0
        for j in range(steps):
            h, _, _ = self.module(j + 1)(h, self.embed_tokens(shift_left(ids, 1 + j)), cos, sin)  # [B, T, d]
            yield h

    def depth_logits(self, ids: torch.Tensor, last_state: torch.Tensor, steps: int):
        """Depth j+1's teacher-forced logits [B, T, V] for j < ``steps``."""
        for j, h in enumerate(self.depth_states(ids, last_state, steps)):
            yield self.logits(j + 1, h)

    def teacher_forced_logits(self, ids: torch.Tensor, feats: Any, at: int, steps: int) -> torch.Tensor:
        out = torch.stack([lg[0, at] for lg in self.depth_logits(ids, feats.last_state, steps)]).float()  # [steps, V]
        return self.on_draft_vocab(out)

    def training_loss(self, batch: dict[str, torch.Tensor], feats: Any) -> HeadOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        valid = batch.get("attention_mask", torch.ones_like(ids))
        B, T = ids.shape
        K = self.num_steps
        t_top = feats.all_logits().argmax(-1)  # [B, T] the target's next-token guess at each position
        loss = feats.last_state.new_zeros((), dtype=self.eh_dtype)
        correct, total, accepted = (torch.zeros(K, device=ids.device) for _ in range(3))
        for j, h in enumerate(self.depth_states(ids, feats.last_state, K)):
            lj, correct[j], total[j], accepted[j] = lookahead_loss(
                h, lambda x, d=j + 1: self.logits(d, x), ids, loss_mask, valid, t_top, 1 + j,
                feats.all_logits() if self.soft else None)
            if self.feature_weight:
                lj = lj + self.feature_weight * self.depth_regression(j, h, feats, loss_mask, valid)
            loss = loss + self.loss_weights[j] * lj
        return HeadOutput(loss=loss, correct=correct, total=total, accepted=accepted if self.soft else None)

    def depth_regression(self, j: int, h: torch.Tensor, feats: Any, loss_mask: torch.Tensor,
                         valid: torch.Tensor) -> torch.Tensor:
        """Smooth-L1 of depth j+1's output h [B, T, d] at t onto the depth-0 input at t+1+j (the target's final-norm
        feature that predicts the same token t+2+j), over the positions whose token t+2+j the token loss scores."""
        w = (shift_left(loss_mask, 2 + j) * shift_left(valid, 2 + j)).float()  # [B, T]
        return feature_regression(h, shift_left(feats.last_state, 1 + j), w)

    # -- inference (the decoder's Drafter protocol) ----------------------------------------------
    # State, with n = tokens the target has processed (the pending token excluded):
    #   _ids   [n]                 those tokens
    #   _kv[j-1] KVBuffer [1, H, c_j, hd]  depth j's cache: its positions 0..c_j-1 whose inputs are all known
    #                              (c_j = n-j+1 after a round that ran depth j; the pending token counts as known)
    #   _rows[i] [1, r, d]         depth-i states of known positions not yet in depth i+1's cache
    #                              (positions c_{i+1}.. ; _rows[0]: the target's last states)
    def start(self, prompt_ids: torch.Tensor, feats: Any) -> None:
        self.reselect_if_stale()
        self._ids = prompt_ids.view(-1).to(self.lm_head.weight.device)
        self._kv: list[KVBuffer] = []
        self._rows = [feats.last_state[:1].to(self.lm_head.weight.device, self.eh_dtype)]

    def commit(self, tokens: torch.Tensor, feats: Any) -> None:
        """Accepted tokens ``[x, d_1..d_n]`` (processed by the target) and their last states; drafts of the
        round were never cached, so there is nothing to crop."""
        self._ids = torch.cat([self._ids, tokens.view(-1).to(self._ids.device)])
        self._rows[0] = torch.cat([self._rows[0], feats.last_state[:1].to(self._rows[0])], 1)

    @torch.no_grad()
    def propose(self, pending: int, k: int, sampler: Sampler) -> Proposal:
        n = self._ids.numel()
        steps = min(k, self.max_draft or k)
        seq = torch.cat([self._ids, self._ids.new_tensor([pending])])  # x_0..x_n, then the drafts as they come
        tokens, probs = [], []
        out = None  # depth j-1's states this round, at positions c_{j-1}..n-1
        for j in range(1, steps + 1):
            cache, c = self._depth(j)
            prev = self._rows[j - 1] if out is None else torch.cat([self._rows[j - 1], out], 1)  # [1, n-c, d]
            cos, sin = self.rotary(range(c, n))  # positions c..n-1, which read tokens c+j..n-1+j
            # the round's last depth, with no deeper depth to hand its rows to: only position n-1's output is used
            tail = 1 if j == steps and not self._deeper(j) else None
            out, _, _ = self.module(j)(prev, self.embed_tokens(seq[None, c + j: n + j]), cos, sin, cache, tail=tail)
            known = max(0, n - j + 1)  # depth j's positions < known have every input known (token t+j <= x_n)
            cache.keep(known - c)
            known_prev = n if j == 1 else max(0, n - j + 2)
            self._rows[j - 1] = prev[:, known - c: known_prev - c]  # depth j-1 states depth j has not cached yet
            h_last = self.module(j).head_input(out[0, -1])  # position n-1 predicts x_{n+j}
            t, q = self.draw_rows(self.rows_logits(h_last)[None], sampler)  # a target id, q [1, V] or None
            t, q = int(t[0]), None if q is None else q[0]
            tokens.append(t)
            probs.append(q)
            seq = torch.cat([seq, seq.new_tensor([t])])
            last, last_c, last_known = j, c, known
        if tokens and self._deeper(last):  # keep the deepest run's known states for depth last+1
            self._rows[last] = torch.cat([self._rows[last], out[:, : last_known - last_c]], 1)
        return proposal(tokens, probs)

    def _deeper(self, j: int) -> bool:
        """Whether a depth after ``j`` may ever run (and so read depth j's states)."""
        return j < self.num_steps or self.reuse_last_module

    def _depth(self, j: int) -> tuple[KVBuffer, int]:
        """Depth j's cache and its length c; a new depth (first round, or deeper than ever with reuse_last_module)
        starts empty."""
        if len(self._kv) < j:
            self._kv.append(KVBuffer())
            self._rows.append(self._rows[0][:, :0])
        return self._kv[j - 1], self._kv[j - 1].n

    def _tree_depth(self, j: int, seq: torch.Tensor, below: torch.Tensor | None, paths: torch.Tensor,
                    spec_below: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Module j for m frontier nodes of depth j−1 (j = 1: the root alone, m = 1) in one tree round.

        seq [n+1] x_0..x_n; below: depth j−1's known states of this round [1, known_{j-1}−c_{j-1}, d] (j = 1: None);
        paths [m, j−1]: each node's drafts d_1..d_{j−1}; spec_below [m, n−known_{j-1}, d]: depth j−1's states of each
        node's parent at the positions that read drafts. Returns depth j's known states [1, known−c, d] (the same
        for every path; cached once; none past the last module, which no depth reads), its speculative states
        [m, n−known, d] and the logits at n−1 [m, V]."""
        n, dev = seq.numel() - 1, seq.device
        cache, c = self._depth(j)
        mod = self.module(j)
        prev = self._rows[j - 1] if below is None else torch.cat([self._rows[j - 1], below], 1)  # [1, known_{j-1}-c, d]
        known = max(0, n - j + 1)  # positions whose token t+j is known
        m, s = paths.shape[0], n - known  # s: positions known..n-1 read drafts (j = 1: none)
        out = prev[:, :0]
        if known > c:  # the shared positions c..known-1, once, into depth j's cache
            cos, sin = self.rotary(range(c, known))
            # no deeper depth reads them: keyed only (but position n-1's output where it is one of them, j = 1)
            tail = None if self._deeper(j) else (1 if s == 0 else 0)
            out, _, _ = mod(prev[:, : known - c], self.embed_tokens(seq[None, c + j: known + j]), cos, sin, cache,
                            tail=tail)
            cache.keep()
        self._rows[j - 1] = prev[:, known - c:]  # depth j-1 states depth j has not cached yet
        if s == 0:
            return out, out[:, :0].expand(m, -1, -1), self.draft_logits(j, out[:, -1]).expand(m, -1)
        pos = torch.arange(known, n, device=dev)  # [s]
        emb = self.embed_tokens(paths[:, pos + j - n - 1])  # [m, s, d]: position t reads d_{t+j-n}
        h_prev = torch.cat([self._rows[j - 1].expand(m, -1, -1), spec_below], 1)  # [m, s, d]: known rows, then the path's
        cos, sin = (t.repeat(1, 1, m, 1) for t in self.rotary(range(known, n)))  # [1, 1, m·s, hd]
        own = torch.block_diag(*[torch.ones(s, s, dtype=torch.bool, device=dev).tril()] * m)  # [m·s, m·s]
        mask = torch.cat([torch.ones(m * s, cache.n, dtype=torch.bool, device=dev), own], 1)  # cache + own rows
        o, _, _ = mod(h_prev.reshape(1, m * s, -1), emb.reshape(1, m * s, -1), cos, sin, cache, mask)
        cache.keep(0)  # the paths' rows are speculative
        o = o.view(m, s, -1)
        return out, o, self.draft_logits(j, o[:, -1])  # position n-1 predicts the token after each node

    @torch.no_grad()
    def propose_tree(self, pending: int, tree: TreeSpec, sampler: Sampler) -> Proposal:
        """A draft tree (:func:`models.heads.trees.grow_tree`): module j expands the nodes of depth j−1, one forward
        per level (:meth:`_tree_depth`).

        Every path is the chain ``propose`` would run with that path's drafts. At depth j the positions < known =
        n−j+1 read only known tokens: they are the same for every path, run once and enter depth j's cache (as in
        the chain). The last n−known positions read drafts (position t: token t+j, d_1..d_{j−1} of the path) and the
        parent path's depth-(j−1) states: they run per frontier node, all nodes packed into one block whose mask lets
        each node's rows see the cache and, causally, only its own rows. Nothing speculative is cached."""
        tree = self.within_reach(tree)
        seq = torch.cat([self._ids, self._ids.new_tensor([pending])])  # x_0..x_n
        below, spec, root = self._tree_depth(1, seq, None, seq.new_zeros(1, 0), None)
        deepest = 1
        states = {-1: spec[0]}  # node → its children's module's states at the positions that read drafts [s, d]

        def expand(nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            nonlocal below, deepest
            deepest = int(node_depths(parents)[nodes[0]]) + 1
            paths = torch.stack([tokens[path_to(x, parents)] for x in nodes]).to(seq.device)  # [m, deepest-1]
            spec_below = torch.stack([states[int(parents[x])] for x in nodes])
            below, spec, logits = self._tree_depth(deepest, seq, below, paths, spec_below)
            states.update({x: spec[i] for i, x in enumerate(nodes)})
            return logits

        prop = grow_tree(root[0], expand, tree, sampler, vocab=self.vocab())
        if self._deeper(deepest):  # keep the deepest run's known states for the next depth
            self._rows[deepest] = torch.cat([self._rows[deepest], below], 1)
        return prop
