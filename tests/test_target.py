"""Frozen target wrapper on random-weight tiny Llama, Qwen3 and Mistral: tap indexing, last state, logits, frozen."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from data.errors import UserError
from models.target import FrozenTarget, check_collectable, default_tap_layers, hf_hidden_index


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_taps_last_state_and_logits(arch):
    model = tiny_model(arch, layers=6)
    target = FrozenTarget(model=model, tap_layers=[0, 2, 5])
    ids = torch.randint(0, 128, (2, 9))
    out = target(ids)
    assert out.tap_states.shape == (2, 9, 3, 32) and out.last_state.shape == (2, 9, 32) and out.logits is None
    # tap i is the output of decoder layer i: check against running the layers by hand
    ref = model(ids, output_hidden_states=True)
    for k, layer in enumerate([0, 2]):
        assert torch.equal(out.tap_states[:, :, k], ref.hidden_states[hf_hidden_index(layer)])
    captured = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, i, o, at=i: captured.setdefault(at, o[0] if isinstance(o, tuple) else o)) for i in (2, 5)]
    target(ids)
    for h in hooks:
        h.remove()
    assert torch.allclose(captured[2], out.tap_states[:, :, 1])
    # the last layer's tap is its output, before the final norm (Hugging Face's last hidden_states entry is after it)
    assert torch.equal(captured[5], out.tap_states[:, :, 2])
    assert not torch.allclose(out.tap_states[:, :, 2], ref.hidden_states[-1])
    # the last state is what feeds lm_head, and logits come only when asked
    with_logits = target(ids, return_logits=True)
    assert torch.allclose(model.lm_head(out.last_state), ref.logits, atol=1e-5)
    assert torch.allclose(with_logits.logits, ref.logits, atol=1e-5)


def test_frozen_eval_no_grad():
    target = FrozenTarget(model=tiny_model("llama"), tap_layers=[1])
    target.train()
    assert not target.model.training
    assert all(not p.requires_grad for p in target.parameters())
    out = target(torch.randint(0, 128, (1, 4)), return_logits=True)
    assert not out.logits.requires_grad


def test_default_taps():
    assert default_tap_layers(36, "eagle3") == [1, 17, 32]
    assert default_tap_layers(32, "eagle3") == [1, 15, 28]
    assert default_tap_layers(36, "dflash") == [1, 9, 17, 25, 33]
    assert default_tap_layers(6, "eagle3") == [1, 2, 3] and default_tap_layers(4, "eagle3") == [0, 1, 2]
    assert default_tap_layers(8, "eagle3") == [1, 3, 4]  # L - 4 = 4 after the collision bump; never L - 1
    for L in range(4, 40):  # every default of a family that reads taps is a tap engines collect
        for method in ("eagle3", "dflash"):
            check_collectable(default_tap_layers(L, method), L)
    assert FrozenTarget(model=tiny_model("llama", layers=6)).tap_layers == [1, 2, 3]


def test_bad_taps_and_paths(tmp_path):
    with pytest.raises(UserError, match="out of range"):
        FrozenTarget(model=tiny_model("llama", layers=4), tap_layers=[1, 4])
    with pytest.raises(UserError, match="no such model directory"):
        FrozenTarget(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="dtype"):
        FrozenTarget("embedded", dtype="int3")


def test_device_cpu_and_a_missing_gpu(monkeypatch):
    """device=cpu puts the weights there; asking for a GPU where none is visible is one UserError, not a traceback."""
    target = FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device="cpu")
    assert target.device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:1"):
        with pytest.raises(UserError, match=f"device='{dev}' but no GPU is visible; use device=cpu"):
            FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device=dev)
    with pytest.raises(UserError, match="device='gpu7'"):
        FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device="gpu7")
    assert FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device="auto").device.type == "cpu"


def test_cpu_kernels_only_for_a_target_on_the_cpu(monkeypatch):
    """fast_linear times and packs CPU kernels on a CPU only: a target elsewhere (here the meta device) keeps the
    model's own linear layers, times nothing and holds no packed copy."""
    import models.target as mt

    def boom(*a, **k):
        raise AssertionError("timed or packed a target that is not on the CPU")

    monkeypatch.setattr(mt, "choose_model_kernels", boom)
    monkeypatch.setattr(mt, "pack_linears", boom)
    for fast in (True, "packed"):
        target = FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device="meta", fast_linear=fast)
        assert target.device.type == "meta" and target.fast_linear is False
        assert target.linear_kernels == {} and target.packed_linears == 0
        assert all(type(m) is torch.nn.Linear for m in target.model.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(AssertionError, match="timed or packed"):  # on the CPU the same call does time
        FrozenTarget(model=tiny_model("llama"), tap_layers=[1], device="cpu", fast_linear=True)


def test_taps_come_from_pre_hooks_not_every_hidden_state(monkeypatch):
    """The forward asks the model for no hidden_states (which would keep every layer's): hooks record the taps, the
    same tensors output_hidden_states gives for layers 0..L-2; changing the taps moves the hooks."""
    model = tiny_model("llama", layers=6)
    target = FrozenTarget(model=model, tap_layers=[0, 3], fast_linear=False)
    ids = torch.randint(0, 128, (1, 7))
    ref = model(ids, output_hidden_states=True).hidden_states
    seen = {}
    inner = model.model.forward

    def spy(*a, **k):
        seen["output_hidden_states"] = k.get("output_hidden_states")
        return inner(*a, **k)

    monkeypatch.setattr(model.model, "forward", spy)
    out = target(ids)
    assert seen["output_hidden_states"] is False
    assert torch.equal(out.tap_states[:, :, 0], ref[1]) and torch.equal(out.tap_states[:, :, 1], ref[4])
    target.set_tap_layers([4])
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 1
    assert torch.equal(target(ids).tap_states[:, :, 0], ref[5])


def test_a_tap_engines_do_not_collect_is_refused():
    with pytest.raises(UserError, match=r"tap_layers=\[1, 3, 5\]: tap 5 is the output of the last decoder layer.*0\.\.4"):
        check_collectable([1, 3, 5], 6)
    check_collectable([1, 3, 4], 6)


def test_logits_at_some_rows_run_the_output_layer_on_those_rows_once():
    target = FrozenTarget(model=tiny_model("llama"), tap_layers=[1])
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    out = target(ids)
    assert out.logits is None
    seen = []
    head = out.lm_head
    out.lm_head = lambda x: (seen.append(x.shape[0]), head(x))[1]
    b, t = torch.tensor([1, 0, 1, 1, 0]), torch.tensor([3, 9, 3, 0, 9])  # 3 distinct rows, 5 asked
    z, inv = out.logits_at(b, t)
    assert seen == [3] and z.shape == (3, 128) and inv.shape == (5,)
    torch.testing.assert_close(z[inv], target(ids, return_logits=True).logits[b, t])
    torch.testing.assert_close(out.all_logits(), target(ids, return_logits=True).logits)
