"""Regularisers and selection in the shared training path: feature noise (training steps only), checkpoint choice."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT
from data.errors import UserError
from test_heads import batch, make_head
from train.module import DraftModule, with_feature_noise


def test_feature_noise_only_in_training_and_never_on_the_teacher():
    target, head = make_head(ROOT / "conf" / "draft" / "eagle3.yaml", ttt_steps=2)
    b = batch()
    clean = DraftModule(target, head)
    noisy = DraftModule(target, head, feature_noise_std=0.5)
    with torch.no_grad():
        noisy.train()
        a, c = noisy._step(b).loss, noisy._step(b).loss
        assert a != c  # fresh noise every step
        noisy.eval()  # validation: the features as they are
        assert torch.equal(noisy._step(b).loss, clean.eval()._step(b).loss)
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    out = with_feature_noise(feats, 0.1)
    assert out.logits is feats.logits  # the teacher's distribution is not perturbed
    assert not torch.equal(out.tap_states, feats.tap_states) and not torch.equal(out.last_state, feats.last_state)
    assert (out.tap_states - feats.tap_states).std().item() == pytest.approx(0.1, rel=0.1)
    with pytest.raises(UserError, match="feature_noise_std"):
        DraftModule(target, head, feature_noise_std=-1)


def test_checkpoints_are_chosen_by_val_acc_len_and_the_noise_option_is_in_the_config():
    cb = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml").checkpoint
    assert cb.monitor == "val/acc_len" and cb.mode == "max" and cb.filename == "best"
    assert OmegaConf.load(ROOT / "conf" / "train.yaml").optim.feature_noise_std == 0.0
    assert OmegaConf.load(ROOT / "conf" / "draft" / "eagle3.yaml").freeze_lm_head is False
