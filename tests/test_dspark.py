"""DSpark specifics: Markov head shapes, confidence targets in [0, 1], lossless greedy decoding with confidence cuts."""
from __future__ import annotations

import torch

from conftest import ROOT
from test_heads import batch, make_head

CFG = ROOT / "conf" / "draft" / "dspark.yaml"


def test_markov_and_confidence_shapes():
    target, head = make_head(CFG, markov_rank=8)
    assert head.markov_in.weight.shape == (128, 8) and head.markov_out.weight.shape == (128, 8)
    h = torch.randn(3, 5, target.hidden_size)
    prev = torch.randint(0, 128, (3, 5))
    logits, conf = head.slot_outputs(h, prev)
    assert logits.shape == (3, 5, 128) and conf.shape == (3, 5)
    # the Markov bias starts at zero: an untrained DSpark is its DFlash backbone
    assert torch.allclose(logits, head.lm_head(h))


def test_confidence_target_and_metrics_in_range():
    target, head = make_head(CFG, markov_rank=8)
    b = batch()
    out = head.training_loss(b, target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True))
    assert 0.0 <= float(out.metrics["tv"]) <= 1.0 and 0.0 <= float(out.metrics["confidence"]) <= 1.0
    assert out.correct.shape == (head.block_size,) and torch.isfinite(out.loss)
