"""The shared training path: checkpoint choice, the T=1 acceptance validation reports."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT
from test_heads import batch, make_head
from train.module import DraftModule


def test_checkpoints_are_chosen_by_val_acc_len():
    cb = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml").checkpoint
    assert cb.monitor == "val/acc_len" and cb.mode == "max" and cb.filename == "best"
    assert OmegaConf.load(ROOT / "conf" / "draft" / "eagle3.yaml").freeze_lm_head is False


T1_CONFIGS = [ROOT / "conf" / "draft" / f"{n}.yaml" for n in ("eagle", "eagle3", "medusa", "medusa_hydra", "mtp", "mtp_speculators")]


@pytest.mark.parametrize("cfg_path", T1_CONFIGS, ids=lambda p: p.stem)
def test_validation_reports_the_t1_acceptance(cfg_path):
    """Trained against the target's distribution, a head's loss also sums Σ_v min(p, q) per step (the T=1
    acceptance), and validation logs val/accept_t1_j and val/acc_len_t1 from those sums."""
    soft = {"soft": True} if "soft" in OmegaConf.load(cfg_path) else {}
    target, plain = make_head(cfg_path, **soft)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    with torch.no_grad():
        o0 = plain.training_loss(b, feats)
    assert o0.accepted is not None
    rate = o0.accepted / o0.total
    assert ((rate > 0) & (rate < 1)).all()

    class Trainer:  # what on_validation_epoch_end reads of Lightning's trainer
        world_size = 1

    module = DraftModule(target, plain)
    logged = {}
    module.log = lambda k, v, **_: logged.__setitem__(k, v)
    module._trainer = Trainer()
    module.eval()
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.validation_step(b, 0)
    module.on_validation_epoch_end()
    assert logged["val/accept_t1_0"] == pytest.approx(float(rate[0]))
    assert 1.0 < logged["val/acc_len_t1"] < 1.0 + len(rate)


def test_eagle3_t1_acceptance_counts_the_mass_outside_its_draft_vocabulary_as_rejected():
    """With a reduced draft vocabulary the reported acceptance is Σ_v min(p_v, q_v) against the target's full
    distribution p (a draft token outside it can never be drawn), not against p renormalised on the vocabulary."""
    from models.heads.eagle3 import step_weights
    from models.layers import shift_left

    target, head = make_head(ROOT / "conf" / "draft" / "eagle3.yaml", ttt_steps=1, draft_vocab_size=64)
    head.prepare_from_data(torch.arange(128, 0, -1).float())  # the draft vocabulary: target ids 0..63
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    with torch.no_grad():
        out = head.training_loss(b, feats)
        q = torch.softmax(head.logits_of(next(iter(head.unroll(b["input_ids"], b["attention_mask"], feats, 1)))).float(), -1)
    p = torch.softmax(feats.logits.float(), -1)[..., head.draft_ids()]  # [B, T, 64] the full distribution's rows
    w = step_weights(b["loss_mask"], head.t2d[feats.logits.argmax(-1)], b["attention_mask"], 0)
    exact = (torch.minimum(shift_left(p, 1), q).sum(-1) * w).sum()
    renormalised = (torch.minimum(shift_left(p / p.sum(-1, keepdim=True), 1), q).sum(-1) * w).sum()
    assert float(out.accepted[0]) == pytest.approx(float(exact), rel=1e-4)
    assert float(renormalised) > float(exact) * 1.05  # the mass outside the 64 rows is not small here
