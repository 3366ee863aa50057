"""Shared blocks: the TTT mask and its fast attention, RMSNorm/rotary against Hugging Face, expected acceptance length."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers import RMSNorm, Rotary, apply_rotary, causal_mask, expected_acceptance_length, ttt_attention, ttt_mask


def test_ttt_mask_pattern():
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], causal_mask(4))
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))
    # query 2 at step 2 sees step-0 keys 0..2 and its own key at steps 1 and 2: five keys
    assert m[2].sum() == 5 and m[2, 3] == 0 and m[2, 4 + 1] == 0


def test_ttt_attention_equals_sdpa_with_explicit_mask():
    torch.manual_seed(0)
    B, H, T, hd, steps = 2, 3, 6, 8, 3
    keys = [torch.randn(B, H, T, hd) for _ in range(steps + 1)]
    values = [torch.randn(B, H, T, hd) for _ in range(steps + 1)]
    q = torch.randn(B, H, T, hd)
    fast = ttt_attention(q, keys, values)
    ref = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=ttt_mask(T, steps))
    assert torch.allclose(fast, ref, atol=1e-5)
    # padding keys are never attended
    valid = torch.ones(B, T, dtype=torch.long)
    valid[0, 4:] = 0
    fast = ttt_attention(q, keys, values, key_valid=valid)
    mask = ttt_mask(T, steps).expand(B, 1, T, T * (steps + 1)).clone()
    mask[0, :, :, 4:T] = False
    ref = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
    assert torch.allclose(fast[0, :, :4], ref[0, :, :4], atol=1e-5) and torch.allclose(fast[1], ref[1], atol=1e-5)


def test_rmsnorm_and_rotary_match_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    x = torch.randn(2, 5, 16)
    ours, theirs = RMSNorm(16), LlamaRMSNorm(16, eps=1e-6)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    cos, sin = Rotary(8)(torch.arange(5)[None].expand(2, 5))
    hq, hk = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    assert torch.allclose(apply_rotary(q, cos, sin), hq, atol=1e-6) and torch.allclose(apply_rotary(k, cos, sin), hk, atol=1e-6)


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert abs(expected_acceptance_length([0.5, 0.5]) - 1.75) < 1e-9
    assert expected_acceptance_length([1.0] * 7) == 8.0
