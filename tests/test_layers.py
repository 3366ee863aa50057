"""Shared blocks: the TTT mask and its fast attention, RMSNorm/rotary against Hugging Face, expected acceptance length,
the soft and look-ahead losses against their definitions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.layers import (_RowCE, DecoderLayer, KVBuffer, RMSNorm, Rotary, apply_rotary, causal_mask, expected_acceptance_length, lookahead_loss, row_ce, soft_ce,
                           ttt_attention, ttt_mask)


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


def test_rotary_tables_and_rotation_give_the_values_of_the_definition():
    """A range of positions reads cached tables (grown, and rebuilt after inv_freq changes): exactly what a tensor of
    those positions computes; the roll-based rotation is exactly x·cos + [−x₂; x₁]·sin, in fp32 and bf16."""
    r = Rotary(16, 500.0)
    for a, b in [(0, 1), (3, 9), (250, 700), (0, 5)]:
        for got, want in zip(r(range(a, b)), r(torch.arange(a, b)[None])):
            assert got.shape == (1, 1, b - a, 16) and torch.equal(got, want)
    with torch.no_grad():
        r.inv_freq.mul_(0.5)  # written in place: the tables follow
    assert torch.equal(r(range(2, 4))[0], r(torch.arange(2, 4)[None])[0])
    cos, sin = r(range(0, 7))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 7, 16).to(dtype)
        x1, x2 = x.chunk(2, -1)
        want = (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(dtype)
        assert torch.equal(apply_rotary(x, cos, sin), want)


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert abs(expected_acceptance_length([0.5, 0.5]) - 1.75) < 1e-9
    assert expected_acceptance_length([1.0] * 7) == 8.0


def test_soft_ce_is_the_cross_entropy_against_a_distribution():
    g = torch.Generator().manual_seed(0)
    z, p = torch.randn(5, 7, 11, generator=g) * 3, torch.softmax(torch.randn(5, 7, 11, generator=g) * 3, -1)
    w = torch.rand(5, 7, generator=g)  # a weight per row, so each row's gradient is scaled differently
    torch.testing.assert_close(soft_ce(z, p), -(p * torch.log_softmax(z, -1)).sum(-1))
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (soft_ce(z1, p) * w).sum().backward()
    (-(p * torch.log_softmax(z2, -1)).sum(-1) * w).sum().backward()  # autograd of the definition
    torch.testing.assert_close(z1.grad, (torch.softmax(z, -1) - p) * w[..., None])  # d/dz of −Σ p log softmax(z)
    torch.testing.assert_close(z1.grad, z2.grad)


@pytest.mark.parametrize("chunk_bytes", [4 * 11 * 3, 1 << 20])  # several chunks of 3 rows, and one chunk
def test_row_ce_equals_cross_entropy_against_tokens_and_against_the_targets_rows(monkeypatch, chunk_bytes):
    monkeypatch.setattr(_RowCE, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(2)
    z, teacher = torch.randn(10, 11, generator=g) * 3, torch.randn(6, 11, generator=g) * 3
    labels, rows, w = torch.randint(0, 11, (10,), generator=g), torch.randint(0, 6, (10,), generator=g), torch.rand(10, generator=g)
    p = torch.softmax(teacher[rows], -1)
    for ours, ref in ((lambda x: row_ce(x, labels=labels), lambda x: F.cross_entropy(x, labels, reduction="none")),
                      (lambda x: row_ce(x, teacher=teacher, rows=rows), lambda x: -(p * torch.log_softmax(x, -1)).sum(-1)),
                      (lambda x: row_ce(x, teacher=p, teacher_is_probs=True), lambda x: -(p * torch.log_softmax(x, -1)).sum(-1))):
        z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        torch.testing.assert_close(ours(z1), ref(z2))
        (ours(z1) * w).sum().backward()
        (ref(z2) * w).sum().backward()
        torch.testing.assert_close(z1.grad, z2.grad)
    loss = row_ce(z.clone().requires_grad_(True), labels=labels).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):  # its gradient buffer is scaled in place: never reused
        loss.backward()


@pytest.mark.parametrize("chunk_bytes", [4 * 11 * 3, 1 << 20])
def test_row_ce_returns_the_total_variation_whose_complement_is_the_t1_acceptance(monkeypatch, chunk_bytes):
    """The total variation ½Σ|q − p| it returns beside the cross-entropy (1 − q[label] against a token; against the
    full distribution where p is renormalised on a subset), whose complement Σ min(p, q) is the T=1 acceptance
    chance, and the cross-entropy's gradient, all against autograd's version of the definition."""
    monkeypatch.setattr(_RowCE, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(3)
    z, teacher = torch.randn(10, 11, generator=g) * 2, torch.randn(6, 11, generator=g) * 2
    labels, rows, w = torch.randint(0, 11, (10,), generator=g), torch.randint(0, 6, (10,), generator=g), torch.rand(10, generator=g)
    p = torch.softmax(teacher[rows], -1)

    def ref_soft(x):
        q = torch.softmax(x, -1)
        return -(p * torch.log_softmax(x, -1)).sum(-1), 1 - torch.minimum(p, q).sum(-1)

    def ref_hard(x):
        q_y = torch.softmax(x, -1).gather(1, labels[:, None])[:, 0]
        return F.cross_entropy(x, labels, reduction="none"), 1 - q_y

    mass = torch.rand(6, generator=g) * 0.5 + 0.5  # each teacher row: renormalised on a subset holding this mass

    def ref_subset(x):  # the cross-entropy against p as given; the acceptance against the full distribution
        q, m = torch.softmax(x, -1), mass[rows, None]
        return -(p * torch.log_softmax(x, -1)).sum(-1), 1 - torch.minimum(m * p, q).sum(-1)

    for ours, ref in ((lambda x: row_ce(x, teacher=teacher, rows=rows, return_tv=True), ref_soft),
                      (lambda x: row_ce(x, teacher=teacher, rows=rows, return_tv=True, mass=mass), ref_subset),
                      (lambda x: row_ce(x, labels=labels, return_tv=True), ref_hard)):
        z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        (l1, tv1), (l2, tv2) = ours(z1), ref(z2)
        torch.testing.assert_close(l1, l2)
        torch.testing.assert_close(tv1, tv2.detach())
        (l1 * w).sum().backward()
        (l2 * w).sum().backward()
        torch.testing.assert_close(z1.grad, z2.grad)


def test_lookahead_loss_scores_token_t_plus_1_plus_ahead_at_position_t():
    """Against the definition, position by position: hard CE on ids[t+1+ahead], soft CE against the teacher's
    distribution at t+ahead, weighted by the loss mask of the predicted token; agreement with the teacher's top-1 there."""
    g = torch.Generator().manual_seed(1)
    B, T, V, ahead = 2, 9, 13, 2
    logits, teacher = torch.randn(B, T, V, generator=g) * 2, torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) > 0.3).long()
    valid = torch.ones(B, T, dtype=torch.long)
    valid[1, 7:] = 0
    top, probs = teacher.argmax(-1), torch.softmax(teacher, -1)
    hard_sum, soft_sum, wsum, hits, n, kept = 0.0, 0.0, 0.0, 0, 0, 0.0
    for b in range(B):
        for t in range(T - 1 - ahead):
            w = float(loss_mask[b, t + 1 + ahead] * valid[b, t + 1 + ahead])
            hard_sum += w * float(F.cross_entropy(logits[b, t], ids[b, t + 1 + ahead]))
            soft_sum += w * float(-(probs[b, t + ahead] * torch.log_softmax(logits[b, t], -1)).sum())
            wsum += w
            hits += int(w > 0 and int(logits[b, t].argmax()) == int(top[b, t + ahead]))
            n += int(w > 0)
            kept += float(w > 0) * float(torch.minimum(probs[b, t + ahead], torch.softmax(logits[b, t], -1)).sum())
    hard = lookahead_loss(logits, lambda x: x, ids, loss_mask, valid, top, ahead)
    soft = lookahead_loss(logits, lambda x: x, ids, loss_mask, valid, top, ahead, teacher)
    assert abs(float(hard[0]) - hard_sum / wsum) < 1e-5 and abs(float(soft[0]) - soft_sum / wsum) < 1e-5
    assert float(hard[1]) == float(soft[1]) == hits and float(hard[2]) == n
    assert abs(float(soft[3]) - kept) < 1e-4  # Σ min(p, q) over the scored positions: the T=1 acceptance
    sure = 80.0 * F.one_hot(torch.cat([ids[:, 1:], ids[:, :1]], 1), V).float()  # a teacher certain of the data's next token
    assert torch.allclose(lookahead_loss(logits, lambda x: x, ids, loss_mask, valid, top, ahead, sure)[0], hard[0], atol=1e-5)


def test_kv_buffer_holds_what_concatenation_would():
    """add/keep/crop against a reference built with torch.cat: kept rows survive growth, speculative rows added
    after them are forgotten by keep(m), and every view add returns is the kept rows followed by what was added."""
    g = torch.Generator().manual_seed(0)
    buf, ref_k, ref_v = KVBuffer(), torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0, 3)
    assert buf.kept() is None
    for step in range(60):  # past the first capacity (64 rows) and a doubling
        m = 1 + step % 4
        k, v = torch.randn(1, 2, m, 3, generator=g), torch.randn(1, 2, m, 3, generator=g)
        keys, values = buf.add(k, v)
        extra = torch.randn(1, 2, 2, 3, generator=g)  # a second add in the same round (a chain's next draft)
        keys2, _ = buf.add(extra, extra)
        assert torch.equal(keys, torch.cat([ref_k, k], 2)) and torch.equal(values, torch.cat([ref_v, v], 2))
        assert torch.equal(keys2, torch.cat([ref_k, k, extra], 2))
        keep = step % (m + 1)
        buf.keep(keep)
        ref_k, ref_v = torch.cat([ref_k, k[:, :, :keep]], 2), torch.cat([ref_v, v[:, :, :keep]], 2)
        assert buf.n == ref_k.shape[2] and torch.equal(buf.kept()[0], ref_k) and torch.equal(buf.kept()[1], ref_v)
    assert buf.n > 64
    buf.crop(5)
    assert torch.equal(buf.kept()[0], ref_k[:, :, :5])


def test_decoder_layer_cached_steps_equal_its_causal_forward():
    """Chunks of rows stepped through ``DecoderLayer.cached`` over a KVBuffer give the causal forward's rows; ``tail``
    keys every row but returns only the last ones; an explicit mask is used as given."""
    torch.manual_seed(0)
    layer = DecoderLayer(16, 4, 2, 32).eval()
    rot = Rotary(4)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        full = layer(x, *rot(range(9)))  # [1, 9, 16]
        buf, outs = KVBuffer(), []
        for a, b in [(0, 3), (3, 4), (4, 9)]:
            out, k, v = layer.cached(x[:, a:b], *rot(range(a, b)), buf)
            assert k.shape == (1, 4, b - a, 4) and v.shape == k.shape
            buf.keep()
            outs.append(out)
        assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5)
        buf.crop(4)
        out, _, _ = layer.cached(x[:, 4:9], *rot(range(4, 9)), buf, tail=2)
        assert out.shape == (1, 2, 16) and torch.allclose(out, full[:, 7:], atol=1e-5)
        assert buf.added == 5  # every row keyed
        buf.crop(4)
        none = torch.zeros(5, 9, dtype=torch.bool)
        none[:, 0] = True  # each row sees only position 0: not the causal result
        out, _, _ = layer.cached(x[:, 4:9], *rot(range(4, 9)), buf, mask=none)
        assert not torch.allclose(out, full[:, 4:], atol=1e-3)
        buf.crop(4)
        with pytest.raises(ValueError, match="tail"):
            layer.cached(x[:, 4:9], *rot(range(4, 9)), buf, mask=none, tail=2)
