"""The one copy of the blocks draft heads share: RMSNorm, rotary embedding, attention, SwiGLU MLP, decoder layer, masks, losses.

Shapes: B batch, T tokens, H query heads, Hkv key/value heads, hd head dim, d model width, V vocabulary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from data.errors import UserError
from models.cpu_linear import fused


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the normalisation in fp32, cast back, then the weight. fp32 inputs with an fp32 weight go
    through ``F.rms_norm``, the same arithmetic in one call from Python instead of eight (a one-row draft step is
    mostly per-call cost on a CPU, and a draft token passes four to five of these norms)."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, half-rotation layout as in Llama/Qwen).

    Positions given as a ``range`` (a decoding round's consecutive positions) are read from tables of cos and sin
    for positions 0..N−1, computed once the way a tensor of positions is (the same values) and grown by doubling:
    a drafted token then costs two slices instead of the six operators that compute them."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._tables: tuple | None = None  # (inv_freq it was computed from, its version, cos, sin [1, 1, N, hd])

    def forward(self, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → cos, sin [B, 1, T, hd]; a ``range`` → [1, 1, T, hd] (views of the tables)."""
        if isinstance(positions, range):
            cos, sin = self._table(positions.stop)
            return cos[:, :, positions.start: positions.stop], sin[:, :, positions.start: positions.stop]
        f = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat([f, f], dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def _table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, 1, N ≥ n, hd] of positions 0..N−1 (computed again after inv_freq was moved, cast or written)."""
        t = self._tables
        if t is None or t[0] is not self.inv_freq or t[1] != self.inv_freq._version or t[2].shape[2] < n:
            size = max(256, 2 * n, 0 if t is None else t[2].shape[2])
            cos, sin = self(torch.arange(size, device=self.inv_freq.device)[None])
            self._tables = t = (self.inv_freq, self.inv_freq._version, cos, sin)
        return t[2], t[3]


_HALF_SIGNS: dict = {}


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] → x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂; x₁] computed as a roll of x·[1; −1]
    (the same values in fewer operators; exact: a product by ±1 and a move)."""
    hd = x.shape[-1]
    key = (hd, x.dtype, x.device)
    sign = _HALF_SIGNS.get(key)
    if sign is None:
        sign = _HALF_SIGNS[key] = torch.cat([torch.ones(hd // 2), -torch.ones(hd - hd // 2)]).to(x.device, x.dtype)
    rot = (x * sign).roll(hd // 2, -1)
    if x.dtype == torch.float32 and cos.dtype == torch.float32:
        return x * cos + rot * sin
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped K/V; ``d_in`` may differ from ``d`` (EAGLE-3 feeds 2d-wide inputs).
    Packed for CPU inference (:mod:`models.cpu_linear`), q/k/v are one product."""

    fused_linears = ("q_proj", "k_proj", "v_proj")

    def __init__(self, d: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 d_in: int | None = None, bias: bool = False, qk_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.n_kv = n_heads, n_kv_heads or n_heads
        self.hd = head_dim or d // n_heads
        d_in = d_in or d
        self.q_proj = nn.Linear(d_in, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=False)
        if qk_norm:  # per-head RMSNorm of q and k before RoPE (Qwen3 layers; every published DFlash layer)
            self.q_norm = RMSNorm(self.hd, eps)
            self.k_norm = RMSNorm(self.hd, eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d_in] → q [B, H, T, hd], k, v [B, H, T, hd] (K/V repeated to H heads), rotary applied."""
        B, T, _ = x.shape
        q, k, v = fused(self, x) or (self.q_proj(x), self.k_proj(x), self.v_proj(x))  # [B, T, H·hd], [B, T, Hkv·hd] ×2
        q = q.view(B, T, self.n_heads, self.hd)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), cos, sin), *self._kv_heads(k, v, cos, sin)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`qkv` without the query: rows that are only attended to (DFlash's context) skip q_proj."""
        return self._kv_heads(self.k_proj(x), self.v_proj(x), cos, sin)

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k, v [B, T, Hkv·hd] → [B, H, T, hd] each (k normed where qk_norm, rotary; both repeated to H heads)."""
        B, T, _ = k.shape
        k = k.view(B, T, self.n_kv, self.hd)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, H, T, hd] → [B, T, d]."""
        B, H, T, hd = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        """Plain attention over x itself; ``mask`` boolean [.., T, T] (True = may attend)."""
        q, k, v = self.qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
        return self.out(o)


class MLP(nn.Module):
    """SwiGLU feed-forward (gate and up one product when packed for CPU inference)."""

    fused_linears = ("gate_proj", "up_proj")

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused(self, x) or (self.gate_proj(x), self.up_proj(x))  # [..., d_ff] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm Llama-style block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int | None, d_ff: int, head_dim: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(d, n_heads, n_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = True) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: "KVBuffer",
               mask: torch.Tensor | None = None, tail: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoding step: x [B, m, d] at the m positions after ``past``'s P keys, to which theirs are added (the
        caller keeps or drops them). ``mask`` bool [m, P+m] (default: causal after all past keys); ``tail``: only the
        last ``tail`` rows' outputs are wanted, the others are only keyed. Returns the output [B, m (or tail), d] and
        these positions' k, v [B, H, m, hd]."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)  # [B, H, m, hd] each
        keys, values = past.add(k, v)  # [B, H, P+m, hd]
        m = q.shape[2]
        if tail is not None and tail < m:  # the other rows' keys are added; their outputs are not computed
            if mask is not None:
                raise ValueError("DecoderLayer.cached: tail needs the default causal mask")
            q, x, m = q[:, :, m - tail:], x[:, m - tail:], tail
            if m == 0:
                return x, k, v
        if mask is None and m > 1:  # one row sees every key: no mask
            mask = causal_mask(m, q.device, past=keys.shape[2] - m)
        x = x + self.self_attn.out(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class KVBuffer:
    """A draft's keys and values [B, H, n, hd] over its context, in buffers grown by doubling.

    Decoding adds a few rows a round; ``torch.cat`` onto the cache would copy all of it every time (on a 2-core CPU
    about 30 µs a copy, two per layer and round, several times a drafted token; 2026-12-01). :meth:`add` copies only the new
    rows, after the rows already there, and returns views of everything; :meth:`keep` then says how many of the
    rows added since the last keep stay (the rest, speculative rows of drafted positions, are overwritten by the
    next add). Views returned by ``add`` are valid until the next ``add``."""

    def __init__(self) -> None:
        self._k = self._v = None
        self.n = 0       # rows kept
        self.added = 0   # rows written after them since the last keep

    def add(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, m, hd] after every row held → views [B, H, n + added, hd] of all rows."""
        start, end = self.n + self.added, self.n + self.added + k.shape[2]
        if self._k is None or end > self._k.shape[2]:
            cap = max(64, 2 * end)
            kb, vb = k.new_empty(*k.shape[:2], cap, k.shape[3]), v.new_empty(*v.shape[:2], cap, v.shape[3])
            if start:
                kb[:, :, :start], vb[:, :, :start] = self._k[:, :, :start], self._v[:, :, :start]
            self._k, self._v = kb, vb
        self._k[:, :, start:end], self._v[:, :, start:end] = k, v
        self.added = end - self.n
        return self._k[:, :, :end], self._v[:, :, :end]

    def keep(self, m: int | None = None) -> None:
        """Keep the first ``m`` rows added since the last keep (None: all of them); forget the others."""
        if m is not None and not 0 <= m <= self.added:
            raise ValueError(f"KVBuffer.keep({m}): {self.added} rows were added since the last keep")
        self.n += self.added if m is None else m
        self.added = 0

    def crop(self, n: int) -> None:
        """Keep the first ``n`` rows alone."""
        self.n, self.added = min(n, self.n), 0

    def kept(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views [B, H, n, hd] of the kept rows (None before the first add)."""
        return None if self._k is None else (self._k[:, :, : self.n], self._v[:, :, : self.n])


def causal_mask(T: int, device=None, past: int = 0) -> torch.Tensor:
    """Boolean [T, past + T], True where query i (the i-th of T new positions after ``past`` cached ones) may attend
    key j: every cached key and the new ones up to its own (j <= past + i)."""
    return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(past)


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """EAGLE-3 training-time-test mask for unroll step ``step`` over keys ``[K_0; K_1; ...; K_step]``.

    Boolean [T, T·(step+1)]: a query at position t sees the step-0 keys at positions <= t (causal) and,
    from each later step i in 1..step, only the key at its own position t (its own drafted chain).
    """
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal_mask(T, device)] + [eye] * step, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention under :func:`ttt_mask` without materialising the [T, T·(j+1)] mask.

    q [B, H, T, hd]; keys/values: step 0..j, each [B, H, T, hd]; key_valid [B, T] marks real (non-pad)
    step-0 keys. Step 0 is causal; later steps are diagonal (one score per position).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, T, T]
    allowed = causal_mask(T, q.device)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].bool()
    s0 = s0.masked_fill(~allowed, torch.finfo(s0.dtype).min)
    diag = [((q * k).sum(-1, keepdim=True) * scale) for k in keys[1:]]  # j × [B, H, T, 1]
    p = torch.softmax(torch.cat([s0] + diag, dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :T] @ values[0]
    for i, v in enumerate(values[1:]):
        out = out + p[..., T + i: T + i + 1] * v
    return out


def shift_left(x: torch.Tensor, n: int, fill: float = 0) -> torch.Tensor:
    """x[:, t] ← x[:, t+n] along dim 1, padding the end with ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class _RowCE(torch.autograd.Function):
    """Cross-entropy of each row of logits z [N, V] against a data token or a distribution, −Σ_v p log softmax(z),
    with the gradient computed in the forward pass, a few rows at a time. On a CPU each full-size temporary of autograd's version (log-softmax, the target's
    softmax, products, their backward buffers) costs a pass through memory and fresh pages; chunks of about 1 MB
    stay in cache and only the gradient is full size. The second output, the total variation ½Σ_v |q − p| [N]
    (q = softmax(z); 1 − q[label] against a data token), is not differentiable: 1 − TV = Σ_v min(p, q) is the
    chance that exact rejection sampling at T=1 accepts a token drawn from q (Leviathan et al., arXiv 2211.17192)."""

    CHUNK_BYTES = 1 << 20

    @staticmethod
    def forward(ctx, z: torch.Tensor, labels: torch.Tensor | None, teacher: torch.Tensor | None,
                rows: torch.Tensor | None, teacher_is_probs: bool,
                mass: torch.Tensor | None, want_tv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        N, V = z.shape
        loss, grad, tvd = z.new_empty(N), torch.empty_like(z), z.new_zeros(N)  # tvd stays 0 unless wanted
        c = max(1, _RowCE.CHUNK_BYTES // (4 * V))
        for s in range(0, N, c):
            e = min(N, s + c)
            log_q = torch.log_softmax(z[s:e], -1)  # [c, V]
            g = torch.exp(log_q, out=grad[s:e])  # softmax(z)
            if labels is not None:
                lab = labels[s:e, None]
                loss[s:e] = -log_q.gather(1, lab)[:, 0]
                q_y = g.gather(1, lab)  # [c, 1]
                tvd[s:e] = 1 - q_y[:, 0]
                g.scatter_add_(1, lab, torch.full_like(q_y, -1.0, dtype=g.dtype))  # softmax − one-hot
            else:
                t = teacher[s:e] if rows is None else teacher[rows[s:e]]
                p = t.float() if teacher_is_probs else torch.softmax(t.float(), -1)  # [c, V]
                loss[s:e] = -torch.linalg.vecdot(p, log_q)  # (a batched product is slow for rows this small)
                if want_tv:  # one more pass, over |q − p|
                    if mass is None:
                        pm, rest = p, 0.0
                    else:  # p is renormalised on a subset holding mass m of the full distribution: TV against the full one
                        m = (mass[s:e] if rows is None else mass[rows[s:e]]).float()  # [c]
                        pm, rest = p * m[:, None], 1 - m
                    tvd[s:e] = 0.5 * ((g - pm).abs().sum(-1) + rest)
                g.sub_(p)  # softmax − p
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(tvd)
        return loss, tvd

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_tv: torch.Tensor | None = None):
        if getattr(ctx, "spent", False):
            raise RuntimeError("row_ce: a second backward through the same graph (retain_graph) is not supported")
        ctx.spent = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(g[:, None]), None, None, None, None, None, None  # the buffer is this call's own: scaled in place, once


def row_ce(z: torch.Tensor, labels: torch.Tensor | None = None, teacher: torch.Tensor | None = None,
           rows: torch.Tensor | None = None, teacher_is_probs: bool = False, return_tv: bool = False, mass: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy [N] of logits z [N, V] (differentiable in z only): against the data tokens ``labels``
    [N], or against the target's distribution for each row, ``teacher`` [R, V] (logits, or probabilities with
    ``teacher_is_probs``) at row ``rows`` [N] of it (default: row n for row n). ``return_tv`` also returns the
    total variation ½Σ|q − p| [N] (not differentiable; 1 − it is the T=1 acceptance chance of a token drawn from the head). ``mass`` [R] (rows as
    ``teacher``): the teacher rows are a distribution renormalised on the head's vocabulary, which holds that mass of
    the full one; the cross-entropy reads them as given, the total variation is against the full distribution (the
    mass outside counts as rejected)."""
    if (labels is None) == (teacher is None):
        raise ValueError("row_ce: give exactly one of labels and teacher")
    loss, tvd = _RowCE.apply(z.float(), labels, teacher, rows, teacher_is_probs, mass, return_tv)
    return (loss, tvd) if return_tv else loss


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """−Σ_v p log q per row, q = softmax(logits): logits, target_probs [..., V] → [...]."""
    V = logits.shape[-1]
    out = row_ce(logits.reshape(-1, V), teacher=target_probs.reshape(-1, V), teacher_is_probs=True)
    return out.view(logits.shape[:-1])


def lookahead_loss(hidden: torch.Tensor, project, ids: torch.Tensor, loss_mask: torch.Tensor, valid: torch.Tensor,
                   teacher_top: torch.Tensor, ahead: int, teacher_logits: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss of the logits ``project(hidden)`` that predict token t+1+ahead at position t (Medusa head k, MTP
    depth k+1: ahead = k+1), weighted by that token's loss mask: hard CE on the data token or, given the target's
    logits [B, T, V], soft CE against its distribution for that token (at t+ahead). Also the top-1 agreement with
    the target's own guess there (``teacher_top`` [B, T]).
    Returns (loss, correct, total, accepted): accepted sums Σ_v min(p, q) over the scored positions (the T=1
    acceptance; against a data token, q of that token).

    hidden [B, T, d]; ``project`` maps [N, d] → [N, V]. Only the scored positions (weight > 0, about 60% of a
    padded chat batch) are projected, so the vocabulary product, the loss and their backward skip the rest."""
    n = 1 + ahead
    B, T = ids.shape
    w = loss_mask[:, n:].float() * valid[:, n:].float()  # [B, T-n] weight of the token predicted at t
    b, t = w.nonzero(as_tuple=True)  # the N scored positions
    z = project(hidden[b, t])  # [N, V]
    if teacher_logits is not None:
        loss, tvd = row_ce(z, teacher=teacher_logits.reshape(B * T, -1), rows=b * T + t + ahead, return_tv=True)
    else:
        loss, tvd = row_ce(z, labels=ids[b, t + n], return_tv=True)  # [N], [N]
    wn = w[b, t]
    loss = (loss * wn).sum() / wn.sum().clamp_min(1.0)
    with torch.no_grad():
        hit = z.argmax(-1) == teacher_top[b, t + ahead]
    return loss, hit.sum().float(), wn.new_tensor(float(b.numel())), (1 - tvd).sum()


def loss_weight(value, field: str) -> float:
    """A loss weight from the config: a number >= 0, or one UserError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise UserError(f"{field}={value}: the weight of a loss term, a number >= 0")
    return float(value)


def feature_regression(out: torch.Tensor, ref: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's feature loss (arXiv 2401.15077): smooth-L1 of a draft's output states ``out`` [B, T, d] onto the
    reference states ``ref`` [B, T, d] (the caller aligns and detaches them), averaged over d and weighted per
    position by ``w`` [B, T]."""
    per = F.smooth_l1_loss(out, ref.to(out.dtype), reduction="none").mean(-1)  # [B, T]
    return (per * w).sum() / w.sum().clamp_min(1.0)


def expected_acceptance_length(acc: list[float] | torch.Tensor) -> float:
    """1 + Σ_k Π_{j<=k} acc_j: the expected tokens per verification if step j is accepted with prob acc_j."""
    total, run = 1.0, 1.0
    for a in (acc.tolist() if isinstance(acc, torch.Tensor) else acc):
        run *= float(a)
        total += run
    return total


# -- head set-up shared by the families ---------------------------------------------------------------------
def attention_shape(tc, num_heads: int | None = None, num_kv_heads: int | None = None) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a target-shaped draft layer: the target config ``tc``'s
    unless overridden; a UserError when the counts do not fit the hidden size."""
    d = tc.hidden_size
    n_heads = num_heads or tc.num_attention_heads
    n_kv = num_kv_heads or getattr(tc, "num_key_value_heads", None) or n_heads
    head_dim = getattr(tc, "head_dim", None) or d // n_heads
    if head_dim * n_heads != d and not getattr(tc, "head_dim", None):
        raise UserError(f"draft.num_heads={n_heads} does not divide the target's hidden size {d}")
    if n_heads % n_kv:
        raise UserError(f"draft.num_heads={n_heads} is not a multiple of num_kv_heads={n_kv}")
    return n_heads, n_kv, head_dim


def frozen_embedding(weight: torch.Tensor) -> nn.Embedding:
    """A frozen fp32 copy of a target's token embedding ``weight`` [V, d]."""
    emb = nn.Embedding(*weight.shape)
    emb.weight.data.copy_(weight.data.float())
    emb.from_target = True  # rebuilt from the target on load: exports leave it out (DraftHead.target_copies)
    return emb.requires_grad_(False)


def frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """A frozen fp32 copy of a target's output head ``weight`` [V, d] (no bias)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data.copy_(weight.data.float())
    lin.from_target = True  # rebuilt from the target on load: exports leave it out (DraftHead.target_copies)
    return lin.requires_grad_(False)


def copy_final_norm(norm: nn.Module, target) -> bool:
    """Initialise a draft's final RMSNorm from the target's final norm (the one before its ``lm_head``) when the
    target exposes it (``target.model.model.norm``) with the same shape; returns whether it did."""
    final = getattr(getattr(getattr(target, "model", None), "model", None), "norm", None)
    w = getattr(final, "weight", None)
    if w is None or w.shape != norm.weight.shape:
        return False
    with torch.no_grad():
        norm.weight.copy_(w.float())
    return True
