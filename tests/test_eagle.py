"""EAGLE-1 (the floor) specifics: it drafts in the target's feature space, and its feature loss is aligned."""
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
