"""Medusa specifics: initialisation from the target head, label offsets."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import ROOT
from test_decode_equals_train import check_decode_equals_train, check_tree_equals_train, perturbed
from test_heads import batch, make_head

CFG = ROOT / "conf" / "draft" / "medusa.yaml"


def test_untrained_heads_repeat_the_target_head():
    target, head = make_head(CFG, num_heads=3)
    h = torch.randn(5, target.hidden_size)
    for logits in head.logits(h):
        assert torch.allclose(logits, target.lm_head()(h), atol=1e-5)


def test_head_k_learns_token_t_plus_2_plus_k():
    target, head = make_head(CFG, num_heads=2)
    b = batch(B=1, T=12)
    b["loss_mask"].zero_()
    b["loss_mask"][0, 9] = 1  # only token 9 counts
    feats = target(b["input_ids"], return_logits=True)
    out = head.training_loss(b, feats)
    assert out.total.tolist() == [1, 1]  # head 0 scores position 7, head 1 position 6
    # moving the only scored token changes which positions feed the loss: the loss follows position 7 for head 0
    feats.last_state[0, 7] += 100.0
    assert head.training_loss(b, feats).loss != out.loss


def test_drafting_k_tokens_runs_only_the_first_k_heads():
    """A round that drafts k < num_heads tokens computes k heads' logits, not all (k=auto at T=1 often drafts one),
    and drafts what the full set of heads would."""
    from models.heads.drafting import Sampler

    target, head = make_head(CFG, num_heads=4)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = batch(B=1, T=10)["input_ids"]
    head.start(ids, target(ids))
    calls = []
    hooks = [m.register_forward_hook(lambda mod, i, o, j=j: calls.append(j)) for j, m in enumerate(head.heads)]
    one, four = head.propose(5, 1, Sampler()), head.propose(5, 4, Sampler())
    for x in hooks:
        x.remove()
    assert calls == [0, 0, 1, 2, 3]
    assert one.tokens.tolist() == four.tokens[:1].tolist()


HYDRA = ROOT / "conf" / "draft" / "medusa_hydra.yaml"


def test_untrained_hydra_heads_are_medusa_heads():
    """Hydra's first block starts as the identity on h, so an untrained sequential head repeats the target's head
    whatever tokens it reads."""
    target, head = make_head(HYDRA, num_heads=3)
    h = torch.randn(5, target.hidden_size)
    for k in range(3):
        tokens = torch.randint(0, 128, (5, k + 1), generator=torch.Generator().manual_seed(k))
        assert torch.allclose(head.head_logits(k, h, tokens), target.lm_head()(h), atol=1e-5)


def test_only_hydra_heads_read_the_pending_token_and_the_drafts():
    """Head k's logits at position t change with token t+1+k (the pending token for head 0) for Hydra's heads,
    never for Medusa's, and never with a token after t+1+k for either."""
    for cfg, reads in ((CFG, False), (HYDRA, True)):
        target, head = make_head(cfg, num_heads=3)
        for p in head.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        ids = batch(B=1, T=12)["input_ids"]
        feats = target(ids)
        base = head.teacher_forced_logits(ids, feats, 5, 3)  # [3, V]: heads 0..2 at t = 5
        for j in (6, 7, 8):  # the pending token and the two drafts
            other = ids.clone()
            other[0, j] = (other[0, j] + 1) % 128
            moved = head.teacher_forced_logits(other, feats, 5, 3)
            changed = [not torch.equal(moved[k], base[k]) for k in range(3)]
            assert changed == [reads and k >= j - 6 for k in range(3)], (cfg.stem, j, changed)


@pytest.mark.parametrize("cfg", [CFG, HYDRA], ids=lambda p: p.stem)
def test_prefix_layer_decodes_as_it_trains(cfg):
    """With a prefix layer (its keys cached over the committed text, the last row recomputed at commit) chains and
    trees draft what the teacher-forced training forward gives."""
    check_decode_equals_train(*perturbed(cfg, prefix="tokens"))
    check_tree_equals_train(*perturbed(cfg, prefix="tokens"))


def test_an_untrained_prefix_layer_passes_the_state_through():
    target, head = make_head(HYDRA, num_heads=3, prefix="tokens")
    _, plain = make_head(HYDRA, num_heads=3)
    ids = batch(B=1, T=12)["input_ids"]
    feats = target(ids)
    torch.testing.assert_close(head.teacher_forced_logits(ids, feats, 5, 3), plain.teacher_forced_logits(ids, feats, 5, 3))


def test_the_prefix_layer_reads_the_text_before_and_with_tokens_the_pending_token():
    """Head 0 at t reads the context through the prefix layer (a token before t moves it, through its state), the
    pending token t+1 (which Medusa-1's heads alone never read), and never a later token."""
    for prefix, pending in ((None, False), ("tokens", True)):
        target, head = make_head(CFG, num_heads=2, prefix=prefix)
        for p in head.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        ids = batch(B=1, T=12)["input_ids"]
        feats = target(ids)
        base = head.teacher_forced_logits(ids, feats, 5, 1)[0]
        earlier = copy.deepcopy(feats)
        earlier.last_state[0, 2] += 1.0
        assert (not torch.allclose(head.teacher_forced_logits(ids, earlier, 5, 1)[0], base)) == (prefix is not None)
        for j, moves in ((6, pending), (7, False)):
            other = ids.clone()
            other[0, j] = (other[0, j] + 1) % 128
            assert (not torch.equal(head.teacher_forced_logits(other, feats, 5, 1)[0], base)) == moves, (prefix, j)


def test_a_bad_prefix_is_one_line():
    from data.errors import UserError
    from models.heads.medusa import MedusaHead

    target, _ = make_head(CFG)
    with pytest.raises(UserError, match="draft.prefix='attention'"):
        MedusaHead(target, prefix="attention")
