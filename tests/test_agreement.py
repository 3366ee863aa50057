"""eval.agreement: teacher-forced top-1 on the target's own greedy text beside decoding's acceptance at position 1."""
from __future__ import annotations

import pytest
import torch

from data.errors import UserError
from eval.agreement import agreement, expected_acceptance, sampled_agreement
from test_heads import DRAFT_CONFIGS, make_head


def test_agreement_counts_out_of_vocabulary_tokens_as_misses():
    cfg = next(p for p in DRAFT_CONFIGS if p.stem == "eagle3")
    target, head = make_head(cfg, draft_vocab_size=32)  # a quarter of the 128-token vocabulary
    head.prepare_from_data(torch.arange(128, 0, -1))  # draft vocabulary: ids 0..31
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    res = agreement(target, head.eval(), prompts, max_new_tokens=12, eos=[])
    assert res["positions"] == 2 * 11  # every answer token after the first is predicted once
    assert 0 <= res["teacher_forced_top1"] <= res["teacher_forced_top1_in_draft_vocab"] <= 1
    assert 0 < res["in_draft_vocab_share"] < 1 and res["decode_rounds"] > 0
    # a token outside the draft vocabulary can never be drafted: agreement over all positions <= the in-vocab share
    assert res["teacher_forced_top1"] <= res["in_draft_vocab_share"]
    by_scale = res["sampled_acceptance_at_1_by_draft_scale"]
    assert list(by_scale) == ["0.8", "0.9", "1.0", "1.1", "1.25"] and all(0 <= v <= 1 for v in by_scale.values())


def test_expected_acceptance_is_one_minus_total_variation_and_peaks_at_the_targets_own_scale():
    g = torch.Generator().manual_seed(0)
    target_logits = 3 * torch.randn(50, generator=g)
    # a draft that is the target with its logits doubled: dividing them by 2 gives back p exactly
    acc = expected_acceptance(target_logits, 2 * target_logits, [1.0, 2.0, 4.0])
    assert torch.allclose(acc[1], torch.tensor(1.0), atol=1e-5) and acc[0] < 0.999 and acc[2] < 0.999
    p, q = torch.softmax(target_logits, -1), torch.softmax(2 * target_logits, -1)
    assert torch.allclose(acc[0], 1 - 0.5 * (p - q).abs().sum(), atol=1e-5)  # Σ min(p, q) = 1 − TV(p, q)
    # the target restricted to a draft vocabulary (−inf elsewhere): exactly the mass of p outside it is lost
    draft = target_logits.clone()
    draft[:10] = float("-inf")
    assert torch.allclose(expected_acceptance(target_logits, draft, [1.0])[0], 1 - p[:10].sum(), atol=1e-5)


def test_sampled_agreement_splits_positions_by_pending_token_and_matches_decoding():
    cfg = next(p for p in DRAFT_CONFIGS if p.stem == "eagle")
    target, head = make_head(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a random head that still agrees with the target now and then
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7, 9, 11)]
    res = sampled_agreement(target, head.eval(), prompts, max_new_tokens=40, eos=[], temperature=1.0, k=1)
    roles = res["by_pending_token"]
    assert res["positions"] == 4 * 39 == sum(r["positions"] for r in roles.values())
    assert roles["first"]["positions"] == 4  # one round after each prompt
    # with k=1 every round starts after the first token, a bonus (its draft kept) or a residual draw (rejected)
    assert roles["first"]["positions"] + roles["bonus"]["positions"] + roles["residual"]["positions"] == res["decode_rounds"]
    assert roles["bonus"]["positions"] > 0 and roles["residual"]["positions"] > 0
    # decoding's realised acceptance is a Bernoulli draw per round with the teacher-forced expectation as its mean
    n, e = res["decode_rounds"], res["teacher_forced_acceptance_at_round_starts"]
    assert abs(res["decode_acceptance_at_1"] - e) < 4 * (e * (1 - e) / n) ** 0.5 + 1e-9
    with pytest.raises(UserError, match="temperature"):
        sampled_agreement(target, head, prompts, max_new_tokens=8, eos=[], temperature=0.0)
