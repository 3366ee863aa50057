"""EAGLE-3 specifics: draft vocabulary mapping, step alignment and masking, TTT positions."""
from __future__ import annotations

import torch

from conftest import ROOT
from models.heads.eagle3 import step_weights
from models.heads.vocab import build_draft_vocab, vocab_coverage
from models.layers import shift_left
from test_heads import batch, make_head

CFG = ROOT / "conf" / "draft" / "eagle3.yaml"


def test_draft_vocab_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    draft_ids = torch.arange(4) + d2t
    assert draft_ids.tolist() == [0, 2, 3, 5]  # the 4 most frequent, in id order
    assert t2d.nonzero().flatten().tolist() == draft_ids.tolist()
    # target -> draft -> target is the identity on the draft vocabulary
    t2d_index = torch.cumsum(t2d.long(), 0) - 1
    for tid in draft_ids.tolist():
        did = t2d_index[tid]
        assert did + d2t[did] == tid
    d2t_full, t2d_full = build_draft_vocab(counts, 100)
    assert d2t_full.eq(0).all() and t2d_full.all()
    # the line a training run prints: the share of the loss tokens the vocabulary holds (9 + 9 + 7 + 5 of 34)
    assert vocab_coverage(counts, draft_ids) == ("draft vocabulary: 4 of 8 tokens, 88.24% of the training split's 34 "
                                                 "loss tokens")


def test_step_weights_alignment():
    mask = torch.zeros(1, 12, dtype=torch.long)
    mask[0, 9] = 1  # only token 9 is to be learned
    ones = torch.ones(1, 12, dtype=torch.long)
    for j in range(4):
        w = step_weights(mask, ones.bool(), ones, j)
        assert w.nonzero()[:, 1].tolist() == [9 - 2 - j]  # position t = 9-2-j holds token t+1+j = 8 and predicts 9
    out_of_vocab = ones.bool().clone()
    out_of_vocab[0, 8] = False  # the target's argmax at position 8 (predicting token 9) is outside the draft vocabulary
    assert step_weights(mask, out_of_vocab, ones, 0).sum() == 0
    assert torch.equal(shift_left(torch.arange(5)[None], 2), torch.tensor([[2, 3, 4, 0, 0]]))


def test_positions_outside_draft_vocab_are_masked():
    target, head = make_head(CFG, draft_vocab_size=16)
    counts = torch.zeros(128)
    counts[:16] = 1
    head.prepare_from_data(counts)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    feats.logits[..., 16:] = -1e9  # all argmaxes inside the draft vocabulary
    inside = head.training_loss(b, feats).total
    feats.logits[..., 16:] = 1e9   # all argmaxes outside: nothing is scored
    outside = head.training_loss(b, feats)
    assert (inside > 0).all() and outside.total.sum() == 0 and outside.loss == 0
