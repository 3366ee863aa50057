"""EAGLE-1 (the floor) specifics: it drafts in the target's feature space, and its feature loss is aligned; EAGLE-3's optional one too."""
from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from data.errors import UserError
from models.layers import shift_left
from test_heads import batch, make_head

CFG = ROOT / "conf" / "draft" / "eagle.yaml"


def test_the_target_feature_is_the_input_and_the_next_one_the_regression_target():
    target, head = make_head(CFG)
    assert not hasattr(head, "fc") and not hasattr(head, "norm") and not head.lm_head.weight.requires_grad
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    assert torch.equal(head.fuse(feats), feats.last_state)
    # a perfect feature at step 0 is the target's feature one position on: it costs nothing and gives the target's logits
    w = torch.ones(b["input_ids"].shape)
    perfect = shift_left(feats.last_state, 1)
    assert head.step_loss(0, perfect, feats, w) == 0
    assert head.step_loss(0, feats.last_state, feats, w) > 0
    torch.testing.assert_close(head.logits_of(perfect)[:, :-1], feats.logits[:, 1:])
    # the feature loss counts in training: weight 0 changes the loss, not the accuracies
    torch.manual_seed(0)
    with_feat = head.training_loss(b, feats)
    head.feature_weight = 0.0
    without = head.training_loss(b, feats)
    assert with_feat.loss > without.loss and torch.equal(with_feat.correct, without.correct)


def test_a_negative_feature_weight_is_refused():
    from models.heads.eagle import EagleHead

    target, _ = make_head(CFG)
    with pytest.raises(UserError, match="draft.feature_weight=-1"):
        EagleHead(target, feature_weight=-1)


def test_eagle3_feature_regression_onto_the_next_step_input():
    """``feature_weight``: step j's output at t is regressed onto the step-0 input at t+1+j (``fc`` over the taps
    there, detached), what step j+1 reads in decoding; the target gets no gradient, the output does. Weight 0
    (EAGLE-3's own loss, the config's default) adds nothing."""
    cfg3 = ROOT / "conf" / "draft" / "eagle3.yaml"
    target, plain = make_head(cfg3)
    _, head = make_head(cfg3, feature_weight=0.1)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    w = torch.ones(b["input_ids"].shape)
    x0 = head.fuse(feats).detach()  # [B, T, d]
    assert head.step_loss(1, shift_left(x0, 2), feats, w) == 0 < head.step_loss(1, shift_left(x0, 1), feats, w)
    assert plain.feature_weight == 0 and plain.step_loss(1, shift_left(x0, 1), feats, w) == 0
    h = (shift_left(x0, 2) + 0.5).requires_grad_(True)
    head.zero_grad()
    head.step_loss(1, h, feats, w).backward()
    assert head.fc.weight.grad is None or head.fc.weight.grad.abs().sum() == 0
    assert h.grad is not None and h.grad.abs().sum() > 0
    # in training (the step-0 input computed once for the unroll and the reference) it adds to the loss only
    torch.manual_seed(0)
    with_feat = head.training_loss(b, feats)
    head.feature_weight = 0.0
    without = head.training_loss(b, feats)
    assert with_feat.loss > without.loss and torch.equal(with_feat.correct, without.correct)


def test_eagle3_refuses_bad_feature_options():
    from models.heads.eagle3 import Eagle3Head

    target, _ = make_head(ROOT / "conf" / "draft" / "eagle3.yaml")
    with pytest.raises(UserError, match="draft.feature_weight=-0.5"):
        Eagle3Head(target, feature_weight=-0.5)
