"""DSpark specifics: Markov head shapes, confidence targets in [0, 1], lossless greedy decoding with confidence cuts."""
from __future__ import annotations

import torch

from conftest import ROOT
from eval.decoding.decoder import Sampler, SpeculativeDecoder
from test_decoder import PROMPTS, plain_greedy
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


def test_confidence_cut_blocks_stay_lossless():
    target, head = make_head(CFG, markov_rank=8, confidence_threshold=0.6)
    with torch.no_grad():
        head.confidence.bias.fill_(0.0)  # sigmoid(0) = 0.5 per slot: the product passes 0.6 only for the first token
        head.confidence.weight.zero_()
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ref = plain_greedy(target.model, PROMPTS[1], 15)
    out, st = dec.generate(PROMPTS[1], head, k=6, max_new_tokens=15)
    assert out == ref and len(st.proposed_at) == 1  # every block was cut to one token
    ids = PROMPTS[1][None]
    head.start(ids, target(ids))
    assert head.propose(5, 6, Sampler()).tokens.numel() == 1
    head.confidence_threshold = 0.0
    head.start(ids, target(ids))
    assert head.propose(5, 6, Sampler()).tokens.numel() == 6
    out, st = dec.generate(PROMPTS[1], head, k=6, max_new_tokens=15)
    assert out == ref
