"""DSpark specifics: Markov head shapes, confidence targets in [0, 1], lossless greedy decoding with confidence cuts."""
from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("name", ["dflash", "dflash_anchor", "dspark"])
def test_draft_vocabulary_loss_is_the_full_heads_on_its_rows(name, monkeypatch):
    """``draft_vocab_size``: the loss reads only the vocabulary's rows of the frozen head (and of W2); it equals the full
    head's loss with −inf outside the vocabulary (DSpark's TV then counts the target's mass there whole)."""
    over = {"markov_rank": 8} if name == "dspark" else {"soft": False}  # the data's token: its rows are the vocabulary's
    target, head = make_head(ROOT / "conf" / "draft" / f"{name}.yaml", draft_vocab_size=48, **over)
    head.prepare_from_data(torch.arange(128, 0, -1).float())  # ids 0..47 the most frequent
    assert head.draft_ids().tolist() == list(range(48)) and int(head.t2i[47]) == 47 and int(head.t2i[48]) == -1
    if name == "dspark":
        torch.nn.init.normal_(head.markov_out.weight, std=0.5)
    b = batch()
    b["input_ids"] = b["input_ids"] % 48  # every label inside the vocabulary (the target's mass is not)
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    torch.manual_seed(3)
    out = head.training_loss(b, feats)
    inside = head.t2d.clone()
    monkeypatch.setattr(head, "draft_vocab_size", None)  # the full rows, then −inf outside the vocabulary
    monkeypatch.setattr(head, "rows_logits", lambda h: head.lm_head(h).masked_fill(~inside, float("-inf")))
    if name == "dspark":  # W2 onto the full vocabulary: its rows at the vocabulary's ids (the others meet −inf)
        full = torch.nn.Linear(8, 128, bias=False)
        with torch.no_grad():
            full.weight.zero_()
            full.weight[head.draft_ids()] = head.markov_out.weight
        w2, head.markov_out = head.markov_out, full  # (a submodule: swapped back by hand below)
    torch.manual_seed(3)
    ref = head.training_loss(b, feats)
    torch.testing.assert_close(out.loss, ref.loss)
    assert torch.equal(out.correct, ref.correct) and torch.equal(out.total, ref.total)
    monkeypatch.undo()
    if name == "dspark":
        head.markov_out = w2
    b["input_ids"][:, 10:] += 48  # labels outside the vocabulary are not scored, and nothing goes non-finite
    assert torch.isfinite(head.training_loss(b, target(b["input_ids"], attention_mask=b["attention_mask"],
                                                      return_logits=True)).loss)


@pytest.mark.parametrize("name", ["dflash", "dflash_anchor"])
def test_soft_labels_on_a_one_hot_target_are_the_data_labels(name):
    """``soft``: the cross-entropy against the target's distribution for each slot's token equals the data-label
    loss where the target puts all its mass on the data's next token, and differs where it does not."""
    target, head = make_head(ROOT / "conf" / "draft" / f"{name}.yaml", soft=False)
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    nxt = torch.roll(b["input_ids"], -1, dims=1)  # [B, T] the data's token after each position
    sharp = torch.full_like(feats.logits, -1e4).scatter(-1, nxt[..., None], 0.0)  # [B, T, V] one-hot on it
    torch.manual_seed(3)
    hard = head.training_loss(b, feats).loss
    feats.logits = sharp
    head.soft = True
    torch.manual_seed(3)
    torch.testing.assert_close(head.training_loss(b, feats).loss, hard)
    feats.logits = torch.randn_like(sharp)
    torch.manual_seed(3)
    assert not torch.allclose(head.training_loss(b, feats).loss, hard)
    _, vocab_head = make_head(ROOT / "conf" / "draft" / f"{name}.yaml", draft_vocab_size=48)  # soft on a draft vocabulary
    vocab_head.prepare_from_data(torch.arange(128, 0, -1).float())
    assert torch.isfinite(vocab_head.training_loss(b, feats).loss)
