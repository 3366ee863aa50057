"""The decoder's buffered KV cache and the target's packed linears change no result: the same K/V, crops and
logits as transformers' DynamicCache and MKL's products."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from eval.decoding.decoder import crop, keep_rows
from eval.decoding.kvcache import BufferedLayer, new_cache
from data.errors import UserError
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


def test_a_plan_gives_each_row_count_its_kernel():
    """``PackedLinear(plan=...)``: each row count goes through the kernel its bucket names, bit for bit that kernel's
    product; an in-place change of the weight is followed; FusedLinears' plan may keep the layers apart."""
    from models.cpu_linear import FusedLinears, available

    g = torch.Generator().manual_seed(0)
    lin, other = torch.nn.Linear(24, 40), torch.nn.Linear(24, 8)
    packed_kind = "float32" if available() else "mkl"
    layer = PackedLinear(lin, plan=((1, "mkl_t"), (2, "mkl"), (4, packed_kind)))
    pure = PackedLinear(lin, plan=((1, packed_kind),))
    with torch.no_grad():
        for rows, want in ((1, lambda x: x @ lin.weight.t().contiguous() + lin.bias),
                           (2, lambda x: torch.nn.functional.linear(x, lin.weight, lin.bias)),
                           (3, lambda x: torch.nn.functional.linear(x, lin.weight, lin.bias)),
                           (4, pure), (9, pure)):
            x = torch.randn(1, rows, 24, generator=g)
            assert torch.equal(layer(x), want(x)), rows
            torch.testing.assert_close(layer(x), lin(x), rtol=1e-4, atol=1e-4)
        lin.weight.mul_(2)  # an optimiser step or load_state_dict
        x = torch.randn(1, 1, 24, generator=g)
        torch.testing.assert_close(layer(x), lin(x), rtol=1e-4, atol=1e-4)
        f = FusedLinears(lin, other, plan=((1, "apart"), (2, "mkl_t")))
        assert f(x) is None
        a, b = f(torch.randn(1, 3, 24, generator=g).expand(1, 3, 24))
        assert a.shape == (1, 3, 40) and b.shape == (1, 3, 8)


def test_the_plan_switches_kernel_only_for_a_clear_gain():
    from models.cpu_linear import _best_plan

    times = {"mkl": [10.0, 19.0, 40.0, 80.0], "mkl_t": [9.0, 19.5, 30.0, 60.0], "float32": [30.0, 30.0, 31.0, 40.0]}
    # 1 row: mkl_t; 2 rows: mkl is faster, by less than 5%, so mkl_t stays; 4: mkl_t; 8: float32 (40 against 60)
    assert _best_plan(times, (1, 2, 4, 8)) == ((1, "mkl_t"), (8, "float32"))
    # SmolLM2's steps on the Xeon (ms): mkl_t wins one row by 0.1 ms, mkl two; mkl takes both
    smollm2 = {"mkl": [33.1, 33.2, 47.5, 59.5], "mkl_t": [33.0, 43.9, 49.4, 61.6], "float32": [40.3, 41.3, 42.4, 50.2]}
    assert _best_plan(smollm2, (1, 2, 4, 8)) == ((1, "mkl"), (4, "float32"))
    assert _best_plan({"mkl": [1.0, 1.0]}, (1, 4)) == ((1, "mkl"),)


@pytest.mark.parametrize("fast", [True, "packed"])
def test_a_targets_chosen_kernels_agree_with_f_linear(fast):
    """``fast_linear=true`` (one kernel per row count for the whole model, timed here on whole forwards) and
    ``packed`` give the logits of ``fast_linear=false`` within fp32 rounding at every row count."""
    model = tiny_model("llama", layers=2)
    plain = FrozenTarget(model=model, tap_layers=[1], fast_linear=False)
    fast_t = FrozenTarget(model=copy.deepcopy(model), tap_layers=[1], fast_linear=fast)
    if fast is True:
        plan = fast_t.linear_kernels["plans"]["all"]
        assert plan[0][0] == 1 and all(k in ("mkl", "mkl_t", "float32") for _, k in plan)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    for n in (1, 2, 3, 4, 9):
        torch.testing.assert_close(fast_t(ids[:, :n], return_logits=True).logits,
                                   plain(ids[:, :n], return_logits=True).logits, rtol=1e-4, atol=1e-4)


def test_a_bf16_targets_kernels_are_its_own_bf16_products():
    """A bf16 target (``dtype: bfloat16``) chooses among products of its own bf16 weights (F.linear, the transposed
    copy, oneDNN's packed bf16 weight; never an fp32 copy): outputs stay bf16 and within bf16 rounding of F.linear
    at every row count, and a bf16 layer's plan serves each row count (bf16 in, bf16 out)."""
    from models.cpu_linear import _checked_pack

    model = tiny_model("llama", layers=2).to(torch.bfloat16)
    plain = FrozenTarget(model=model, tap_layers=[1], dtype="bfloat16", fast_linear=False)
    fast_t = FrozenTarget(model=copy.deepcopy(model), tap_layers=[1], dtype="bfloat16", fast_linear=True)
    assert set(fast_t.linear_kernels["step_ms"]) <= {"mkl", "mkl_t", "bfloat16"}
    assert all(k != "float32" for _, k in fast_t.linear_kernels["plans"]["all"])
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    for n in (1, 2, 3, 4, 9):
        out = fast_t(ids[:, :n], return_logits=True).logits
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), plain(ids[:, :n], return_logits=True).logits.float(), rtol=0.05, atol=0.05)
    lin = torch.nn.Linear(24, 40).to(torch.bfloat16)
    packs = _checked_pack(lin, torch.bfloat16, torch.Generator().manual_seed(0)) is not None  # not without AVX-512
    layer = PackedLinear(lin, plan=((1, "mkl_t"), (2, "mkl")) + (((4, "bfloat16"),) if packs else ()))
    with torch.no_grad():
        for rows in (1, 2, 4, 9):
            x = torch.randn(1, rows, 24).to(torch.bfloat16)
            y = layer(x)
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), lin(x).float(), rtol=0.02, atol=0.02)


def test_a_bad_fast_linear_is_one_line():
    with pytest.raises(UserError, match="target.fast_linear='fast'"):
        FrozenTarget(model=tiny_model("llama", layers=1), fast_linear="fast")


def test_a_slow_model_is_timed_once_per_kernel_and_row_count():
    """``slow_s``: where one step takes longer, one round of one timing (after one unrecorded call) per kernel and
    row count, so a large model's load does not spend minutes choosing."""
    from models.cpu_linear import choose_model_kernels

    model = tiny_model("llama", layers=1)
    calls = []

    def step(rows: int) -> None:
        calls.append(rows)
        model(input_ids=torch.zeros(1, rows, dtype=torch.long), use_cache=False)

    out = choose_model_kernels(model, step, kinds=("mkl", "mkl_t"), rows=(1, 4), slow_s=0.0)
    assert len(calls) == 1 + 2 * 2 * 2  # the probe, then per kind and row count one unrecorded call and one timed
    assert set(out["step_ms"]) == {"mkl", "mkl_t"} and out["plans"]["all"][0][0] == 1
