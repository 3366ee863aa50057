"""DFlash specifics: the packed-block mask, label offsets, no leak of the anchor's own features or other blocks."""
from __future__ import annotations

import torch

from conftest import ROOT
from models.heads.dflash import block_mask, block_targets
from test_heads import make_head

CFG = ROOT / "conf" / "draft" / "dflash.yaml"


def test_block_mask():
    anchors, ok = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    m = block_mask(anchors, ok, T=8, block=2)[0, 0]  # [4, 8 + 4]
    assert m.shape == (4, 12)
    for row in (0, 1):  # block 0 (anchor 3): context 0..2, its own two slots
        assert m[row, :8].nonzero().flatten().tolist() == [0, 1, 2]
        assert m[row, 8:].tolist() == [True, True, False, False]
    for row in (2, 3):  # block 1 (anchor 6): context 0..5, never block 0
        assert m[row, :8].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
        assert m[row, 8:].tolist() == [False, False, True, True]
    pad = block_mask(anchors, torch.tensor([[True, False]]), T=8, block=2)[0, 0]
    assert not pad[2, :8].any() and pad[2, 8:].tolist() == [False, False, True, True]


def test_label_offsets_and_weights():
    ids = torch.arange(100, 112)[None]  # token at position p is 100 + p
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 9] = 0
    pos, labels, w = block_targets(ids, mask, torch.ones_like(mask), torch.tensor([[4, 8, 10]]), torch.tensor([[True, True, True]]), 4, 4.0)
    assert pos[0, 0].tolist() == [4, 5, 6, 7] and labels[0, 0].tolist() == [104, 105, 106, 107]  # slot k ↔ token a+k
    assert w[0, 0, 0] == 0 and torch.allclose(w[0, 0, 1:], torch.exp(-torch.arange(3.0) / 4))
    assert w[0, 1, 0] == 0 and w[0, 1, 1] == 0 and (w[0, 1, 2:] > 0).all()  # token 9 is not in the loss mask
    assert w[0, 2, 1] > 0 and (w[0, 2, 2:] == 0).all()  # positions 12, 13 are past the end


def test_no_leak_from_anchor_features_or_other_blocks(monkeypatch):
    target, head = make_head(CFG, num_anchors=2)
    T = 16
    ids = torch.randint(0, 120, (1, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": torch.ones(1, T, dtype=torch.long), "attention_mask": torch.ones(1, T, dtype=torch.long)}
    feats = target(ids, return_logits=True)
    monkeypatch.setattr(head, "sample_anchors", lambda lm, v: (torch.tensor([[5, 10]]), torch.tensor([[True, True]])))
    captured = {}
    orig = head.run_block
    monkeypatch.setattr(head, "run_block", lambda *a: captured.setdefault("h", orig(*a)) if "h" not in captured else orig(*a))

    def block_out(f):
        captured.clear()
        head.training_loss(batch, f)
        return captured["h"][0].view(2, head.block_size, -1)

    base = block_out(feats)
    changed = type(feats)(tap_states=feats.tap_states.clone(), last_state=feats.last_state, logits=feats.logits)
    changed.tap_states[:, 5:] += 10.0  # the anchor's own features and everything after block 0's anchor
    out = block_out(changed)
    assert torch.allclose(out[0], base[0], atol=1e-5)  # block 0 sees only positions < 5
    assert not torch.allclose(out[1], base[1])          # block 1 (anchor 10) does see positions 5..9
    changed.tap_states[:, 4] += 10.0
    assert not torch.allclose(block_out(changed)[0], base[0])
    # another block's tokens never reach block 0
    ids2 = ids.clone()
    ids2[0, 10] = (ids[0, 10] + 1) % 120  # block 1's anchor token
    captured.clear()
    head.training_loss({**batch, "input_ids": ids2}, feats)
    assert torch.allclose(captured["h"][0].view(2, head.block_size, -1)[0], base[0], atol=1e-5)


def test_frozen_embedding_and_head_match_the_target():
    target, head = make_head(CFG)
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens().weight)
    assert torch.equal(head.lm_head.weight, target.lm_head().weight)
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
