"""Every draft config in conf/draft/ on a tiny target: shapes, loss, gradients, frozen parts, export/load round trip.

A new head is tested by adding its YAML file: nothing here names a head.
"""
from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_model
from data.errors import UserError
from models.formats import load_draft
from models.target import FrozenTarget, default_tap_layers

DRAFT_CONFIGS = sorted((ROOT / "conf" / "draft").glob("*.yaml"))


def make_head(cfg_path: Path, layers: int = 6, **over):
    cfg = OmegaConf.load(cfg_path)
    cls = hydra.utils.get_class(cfg._target_)
    target = FrozenTarget(model=tiny_model("llama", layers=layers), tap_layers=default_tap_layers(layers, cls.tap_method, 3))
    cfg = OmegaConf.merge(cfg, over)
    torch.manual_seed(0)
    return target, hydra.utils.instantiate(cfg, target=target, _convert_="all")


def batch(B=2, T=24, V=128):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 8:] = 1
    att = torch.ones(B, T, dtype=torch.long)
    if B > 1:  # the second row is padded from T-4 on
        att[1, T - 4:] = 0
        mask[1, T - 4:] = 0
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": att}


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_head_loss_gradients_and_frozen_parts(cfg_path):
    target, head = make_head(cfg_path)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=head.needs_teacher_logits)
    frozen = {n: p.detach().clone() for n, p in head.named_parameters() if not p.requires_grad}
    out = head.training_loss(b, feats)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.correct.shape == out.total.shape == (head.num_steps,) and (out.total > 0).all()
    out.loss.backward()
    trainable = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in trainable)
    assert sum(p.grad.abs().sum() > 0 for _, p in trainable) >= len(trainable) - 1
    assert all(p.grad is None for n, p in head.named_parameters() if not p.requires_grad)
    # a few optimiser steps change the trainable weights and leave the frozen ones alone
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        head.training_loss(b, feats).loss.backward()
        opt.step()
    assert all(torch.equal(frozen[n], p) for n, p in head.named_parameters() if n in frozen)
    assert not any(p.requires_grad for p in target.parameters())


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_the_loss_is_the_same_with_target_logits_given_or_made_from_the_final_state(cfg_path):
    """Training reads an offline cache without logits: a head asks the target for them (all, or at its rows)."""
    from dataclasses import replace

    over = {"draft_vocab_size": 96} if "draft_vocab_size" in OmegaConf.load(cfg_path) else {}
    target, head = make_head(cfg_path, **over)
    head.prepare_from_data(torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(5)))  # token counts
    b = batch()
    given = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    outs = []
    for feats in (given, replace(given, logits=None)):
        torch.manual_seed(3)  # block heads draw their anchors
        outs.append(head.training_loss(b, feats))
    torch.testing.assert_close(outs[1].loss, outs[0].loss)
    assert torch.equal(outs[1].correct, outs[0].correct) and torch.equal(outs[1].total, outs[0].total)


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_reads_taps_says_whether_the_loss_depends_on_the_tap_states(cfg_path):
    """``reads_taps=False`` lets a head train from a cache written with any taps: true only if its loss ignores them."""
    from dataclasses import replace

    target, head = make_head(cfg_path)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=head.needs_teacher_logits)
    other = replace(feats, tap_states=torch.randn_like(feats.tap_states))
    same = torch.equal(head.training_loss(b, feats).loss, head.training_loss(b, other).loss)
    assert same == (not head.reads_taps)


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_export_load_round_trip(cfg_path, tmp_path):
    target, head = make_head(cfg_path)
    head.prepare_from_data(torch.arange(128).flip(0))
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    head.export(tmp_path / "draft", train_config={"hello": 1})
    loaded = load_draft(tmp_path / "draft", target)
    assert type(loaded) is type(head)
    for (n1, t1), (n2, t2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    torch.manual_seed(0)
    a = head.training_loss(b, feats).loss
    torch.manual_seed(0)
    assert torch.equal(a, loaded.training_loss(b, feats).loss)
    # frozen copies of the target's tensors are not stored: the loader rebuilds them from the target
    from safetensors import safe_open

    with safe_open(str(tmp_path / "draft" / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert not stored & set(head.target_copies())
    assert stored | set(head.target_copies()) == set(head.state_dict())
    # a bf16 export loads into the fp32 head with bf16-rounded weights
    head.export(tmp_path / "bf16", dtype=torch.bfloat16)
    half = load_draft(tmp_path / "bf16", target)
    for k, v in head.state_dict().items():
        w = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() and k not in head.target_copies() else v
        assert torch.equal(half.state_dict()[k], w), k


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_draft_for_another_target_is_refused(cfg_path, tmp_path):
    _, head = make_head(cfg_path)
    head.export(tmp_path / "draft")
    other = FrozenTarget(model=tiny_model("llama", layers=6, vocab_size=96))
    with pytest.raises(UserError, match="vocab_size"):
        load_draft(tmp_path / "draft", other)
    with pytest.raises(UserError, match="not an exported draft"):
        load_draft(tmp_path / "nothing", other)
