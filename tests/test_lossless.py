"""Greedy divergences from plain decoding are told apart: numerical ties (a near-tied argmax flipped by bf16
arithmetic) versus defects (a broken acceptance rule), by :mod:`eval.decoding.lossless`."""
from __future__ import annotations

import pytest
import torch

import eval.decoding.decoder as decoder
from eval.decoding.decoder import NoDrafter, Proposal, Sampler, SpeculativeDecoder
from eval.decoding.lossless import classify, tie_bound
from models.target import FrozenTarget


class Replay:
    """Proposes the next k tokens of a fixed continuation (the plain run's): every verify pass is a full block."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def start(self, prompt_ids, feats):
        self.n = 0

    def commit(self, tokens, feats):
        self.n += tokens.numel()

    def propose(self, pending, k, sampler):
        return Proposal(torch.tensor(self.tokens[self.n + 1: self.n + 1 + k], dtype=torch.long))


def run(target, prompt, drafter, k=6, n=40):
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    return dec.generate(prompt, drafter, k=k, max_new_tokens=n, sampler=Sampler(0.0), record_top=4)


def small_model():
    """Wide enough (d=64) that bf16 block and single-token kernels round differently; 256 tokens of
    vocabulary make near-tied top logits common."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


V = 256


@pytest.fixture(scope="module")
def bf16_target():
    return FrozenTarget(model=small_model(), tap_layers=[0, 1], dtype="bfloat16")


PROMPTS = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in range(3, 13)]


def test_bf16_divergences_are_all_numerical_ties(bf16_target):
    kinds = []
    for p in PROMPTS:
        plain, st = run(bf16_target, p, NoDrafter(), k=0)
        assert len(st.top) == len(plain)
        spec, _ = run(bf16_target, p, Replay(plain))
        kinds.append(classify(plain, spec, st.top, torch.bfloat16).kind)
    assert "defect" not in kinds, kinds
    if "tie" not in kinds:  # e.g. CPUs with AVX-512 BF16, whose block and one-token kernels round alike
        pytest.skip("this CPU's bf16 block and one-token forwards agreed on every argmax: no tie to classify")


def test_fp32_is_identical():
    target = FrozenTarget(model=small_model(), tap_layers=[0, 1], dtype="float32")
    for p in PROMPTS[:4]:
        plain, st = run(target, p, NoDrafter(), k=0)
        spec, _ = run(target, p, Replay(plain))
        assert classify(plain, spec, st.top, torch.float32).kind == "identical"


def test_a_broken_acceptance_rule_is_a_defect(bf16_target, monkeypatch):
    real = decoder.accept_greedy

    def accept_one_too_many(draft, logits):  # accepts the first drafted token even when the target disagrees
        n, nxt = real(draft, logits)
        if n == 0 and draft.numel():
            return 1, int(logits[1].argmax())
        return n, nxt

    kinds = []
    for p in PROMPTS[:4]:
        plain, st = run(bf16_target, p, NoDrafter(), k=0)
        wrong = [(t + 1) % V for t in plain]         # a drafter that is always wrong
        monkeypatch.setattr(decoder, "accept_greedy", accept_one_too_many)
        spec, _ = run(bf16_target, p, Replay(wrong))
        monkeypatch.setattr(decoder, "accept_greedy", real)
        kinds.append(classify(plain, spec, st.top, torch.bfloat16).kind)
    assert kinds == ["defect"] * 4


def test_classify_rules():
    top = [([5, 6, 7, 8], [10.0, 9.99, 5.0, 4.0])] * 3
    assert classify([5, 5, 5], [5, 5, 5], top, torch.bfloat16).kind == "identical"
    v = classify([5, 5, 5], [5, 6, 1], top, torch.bfloat16)
    assert (v.kind, v.position) == ("tie", 1) and v.margin == pytest.approx(0.01)
    assert classify([5, 5, 5], [5, 7, 1], top, torch.bfloat16).kind == "defect"   # margin 5.0 > bound 0.625
    assert classify([5, 5, 5], [5, 9, 1], top, torch.bfloat16).kind == "defect"   # not among the top tokens
    assert classify([5, 5, 5], [5, 6, 1], top, torch.float32).kind == "defect"    # fp32 has no such ties
    assert classify([5, 5, 5], [5, 5], top, torch.bfloat16).kind == "defect"      # a prefix is never rounding
    assert tie_bound(torch.bfloat16, 10.0) == pytest.approx(8 * 2 ** -7 * 10)
