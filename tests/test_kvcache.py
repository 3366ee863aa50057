"""The decoder's buffered KV cache and the target's packed linears change no result: the same K/V, crops and
logits as transformers' DynamicCache and MKL's products."""
from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from conftest import tiny_model
from eval.decoder import crop, keep_rows
from eval.kvcache import BufferedLayer, new_cache
from models.cpu_linear import PackedLinear
from models.target import FrozenTarget


def test_buffered_cache_equals_dynamic_cache():
    target = FrozenTarget(model=tiny_model("llama", layers=2), tap_layers=[1])
    g = torch.Generator().manual_seed(0)
    ours, ref = new_cache(), DynamicCache()
    for step, n in enumerate([200, 1, 3, 70, 2, 1]):  # grows past the first capacity (256)
        ids = torch.randint(0, 128, (1, n), generator=g)
        a, b = target(ids, cache=ours, use_cache=True), target(ids, cache=ref, use_cache=True)
        torch.testing.assert_close(a.last_state, b.last_state, rtol=1e-5, atol=1e-5)
        if step % 2:  # reject the last token, as after a verify pass
            crop(ours, ours.get_seq_length() - 1)
            crop(ref, ref.get_seq_length() - 1)
    assert all(isinstance(layer, BufferedLayer) for layer in ours.layers)
    assert ours.get_seq_length() == ref.get_seq_length() == 200 + 1 + 3 + 70 + 2 + 1 - 3
    keep_rows(ours, 100, [0, 5, 9])
    keep_rows(ref, 100, [0, 5, 9])
    for x, y in zip(ours.layers, ref.layers):
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.values, y.values, rtol=1e-5, atol=1e-5)


def test_packed_linears_agree_with_plain_ones():
    model = tiny_model("llama", layers=2)
    plain = FrozenTarget(model=model, tap_layers=[1], fast_linear=False)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    want = plain(ids, return_logits=True).logits
    packed = FrozenTarget(model=copy.deepcopy(model), tap_layers=[1])
    if not packed.packed_linears:
        return  # this build has no oneDNN: nothing was replaced
    assert isinstance(packed.model.lm_head, PackedLinear) and not isinstance(plain.model.lm_head, PackedLinear)
    torch.testing.assert_close(packed(ids, return_logits=True).logits, want, rtol=1e-4, atol=1e-4)
    for n in (1, 3):
        torch.testing.assert_close(packed(ids[:, :n], return_logits=True).logits, plain(ids[:, :n], return_logits=True).logits,
                                   rtol=1e-4, atol=1e-4)


def test_a_packed_layer_keeps_mkl_below_its_row_count():
    """``from_rows``: fewer rows go through F.linear bit for bit, more through the packed weight; FusedLinears
    declines fewer rows (the caller then uses its layers one by one)."""
    from models.cpu_linear import FusedLinears, available

    if not available():
        return
    g = torch.Generator().manual_seed(0)
    lin, other = torch.nn.Linear(24, 40), torch.nn.Linear(24, 8)
    hybrid, fused = PackedLinear(lin, from_rows=2), FusedLinears(lin, other, from_rows=2)
    with torch.no_grad():
        one, several = torch.randn(1, 1, 24, generator=g), torch.randn(1, 3, 24, generator=g)
        assert torch.equal(hybrid(one), torch.nn.functional.linear(one, lin.weight, lin.bias))
        torch.testing.assert_close(hybrid(several), lin(several), rtol=1e-4, atol=1e-4)
        packed = PackedLinear(lin)
        assert torch.equal(hybrid(several), packed(several))  # the packed product itself, not MKL's
        assert fused(one) is None
        a, b = fused(several)
        torch.testing.assert_close(a, lin(several), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b, other(several), rtol=1e-4, atol=1e-4)
