"""eval.agreement: teacher-forced top-1 on the target's own greedy text beside decoding's acceptance at position 1."""
from __future__ import annotations

import torch

from eval.agreement import agreement
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
