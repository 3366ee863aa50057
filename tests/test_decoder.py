"""The speculative decoder is exactly lossless: greedy output = plain greedy output for every drafter, and
sampled output follows the target's distribution (chi-square on a tiny vocabulary)."""
from __future__ import annotations


import hydra
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_model
from data.errors import UserError
from eval.decoding.lookup import ModelDrafter, NGramDrafter
from eval.decoding.decoder import NoDrafter, Proposal, Sampler, SpeculativeDecoder, accept_greedy
from models.target import FrozenTarget, default_tap_layers


def plain_greedy(model, prompt, n, eos=None):
    ids = prompt.view(1, -1)
    out = []
    for _ in range(n):
        t = int(model(ids).logits[0, -1].argmax())
        out.append(t)
        ids = torch.cat([ids, torch.tensor([[t]])], 1)
        if eos is not None and t in eos:
            break
    return out


class Oracle:
    """Mock drafter proposing the target's own greedy continuation, corrupted with probability `p_wrong`."""

    def __init__(self, model, p_wrong: float, seed: int = 0):
        self.model, self.p_wrong = model, p_wrong
        self.g = torch.Generator().manual_seed(seed)

    def start(self, prompt_ids, feats):
        self.known = prompt_ids.view(-1).tolist()

    def commit(self, tokens, feats):
        self.known += tokens.tolist()

    def propose(self, pending, k, sampler):
        cont = plain_greedy(self.model, torch.tensor(self.known + [pending]), k)
        V = self.model.config.vocab_size
        toks = [t if float(torch.rand((), generator=self.g)) >= self.p_wrong else (t + 1) % V for t in cont]
        return Proposal(torch.tensor(toks))


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(model=tiny_model("llama", layers=4), tap_layers=[1, 2, 3])


PROMPTS = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]


@pytest.mark.parametrize("p_wrong", [0.0, 1.0, 0.4])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_with_mock_drafters(target, p_wrong, k):
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for prompt in PROMPTS:
        ref = plain_greedy(target.model, prompt, 20)
        out, st = dec.generate(prompt, Oracle(target.model, p_wrong), k=k, max_new_tokens=20)
        assert out == ref
        assert st.new_tokens == 20 and st.verified_tokens == 19
        if p_wrong == 0.0:
            assert st.verified_tokens / st.passes > k * 0.8  # always agree: k + 1 per pass (budget aside)
        if p_wrong == 1.0:
            assert st.verified_tokens == st.passes and sum(st.accepted_hist) == 0


def test_eos_inside_an_accepted_block_and_budget_inside_one(target):
    prompt = PROMPTS[0]
    ref = plain_greedy(target.model, prompt, 30)
    eos_tok = ref[6]  # make the 7th generated token an EOS
    stop = ref.index(eos_tok)
    dec = SpeculativeDecoder(target, eos_token_ids=[eos_tok])
    out, _ = dec.generate(prompt, Oracle(target.model, 0.0), k=5, max_new_tokens=30)
    assert out == ref[: stop + 1]
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for budget in (1, 2, 7, 11):
        out, st = dec.generate(prompt, Oracle(target.model, 0.0), k=5, max_new_tokens=budget)
        assert out == ref[:budget] and st.new_tokens == budget


def test_plain_and_ngram_are_lossless(target):
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    prompt = torch.tensor([3, 4, 5, 6, 3, 4, 5, 6, 3, 4])
    ref = plain_greedy(target.model, prompt, 25)
    out, st = dec.generate(prompt, NoDrafter(), k=0, max_new_tokens=25)
    assert out == ref and st.passes == 24
    out, _ = dec.generate(prompt, NGramDrafter(3), k=4, max_new_tokens=25)
    assert out == ref


def test_ngram_lookup():
    d = NGramDrafter(max_ngram=2)
    d.start(torch.tensor([1, 2, 3, 9, 1, 2, 7, 8]), None)
    assert d.propose(1, 3, Sampler()).tokens.tolist() == [2, 7, 8]  # latest match of [8, 1]? none; of [1] -> 2 7 8
    assert d.propose(5, 3, Sampler()).tokens.numel() == 0


def test_small_draft_model_is_lossless(target):
    draft = tiny_model("llama", layers=2)
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ref = plain_greedy(target.model, PROMPTS[1], 16)
    out, _ = dec.generate(PROMPTS[1], ModelDrafter(draft), k=3, max_new_tokens=16)
    assert out == ref


@pytest.mark.parametrize("cfg_path", sorted((ROOT / "conf" / "draft").glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_draft_config_decodes_losslessly(cfg_path, temperature):
    cfg = OmegaConf.load(cfg_path)
    cls = hydra.utils.get_class(cfg._target_)
    model = tiny_model("llama", layers=6)
    target = FrozenTarget(model=model, tap_layers=default_tap_layers(6, cls.tap_method, 3))
    torch.manual_seed(0)
    head = hydra.utils.instantiate(cfg, target=target, _convert_="all")
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    if temperature == 0:
        ref = plain_greedy(model, PROMPTS[1], 18)
        out, st = dec.generate(PROMPTS[1], head, k=4, max_new_tokens=18)
        assert out == ref
    else:
        out, st = dec.generate(PROMPTS[1], head, k=4, max_new_tokens=18, sampler=Sampler(1.0, generator=torch.Generator().manual_seed(0)))
        assert len(out) == 18
    assert st.passes >= 1 and all(0 <= a <= 4 for a in st.accepted_hist)


def test_accept_greedy():
    logits = torch.zeros(4, 10)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 7] = 1
    assert accept_greedy(torch.tensor([3, 5, 2]), logits) == (2, 1)
    assert accept_greedy(torch.tensor([3, 5, 1]), logits) == (3, 7)
    assert accept_greedy(torch.tensor([4, 5, 1]), logits) == (0, 3)


class FixedQ:
    """Mock drafter sampling from a fixed (wrong) distribution q over the vocabulary."""

    def __init__(self, q, with_probs=True):
        self.q, self.with_probs = q, with_probs

    def start(self, p, f):
        pass

    def commit(self, t, f):
        pass

    def propose(self, pending, k, sampler):
        toks = torch.multinomial(self.q, k, replacement=True, generator=sampler.generator)
        return Proposal(toks, self.q.expand(k, -1) if self.with_probs else None)


def sampled_marginals_chi2(make_drafter, N: int = 3000, **generate_kw) -> tuple[list[float], int]:
    """Generate 3 tokens N times from a peaked tiny target (V=6) with ``make_drafter()``; return the chi-square of the
    2nd and 3rd tokens (produced by verification) against their exact marginals, and the drafted tokens accepted.

    N=3000: a 5% shift of probability mass between two tokens moves chi-square by ~N·0.05²/p ≈ 20+, far above the
    0.001 critical value (20.5 at 5 degrees of freedom), so an error of that size fails a bound of 25."""
    torch.manual_seed(0)
    V = 6
    model = tiny_model("llama", vocab_size=V, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a peaked, non-uniform target
    target = FrozenTarget(model=model, tap_layers=[1])
    prompt = torch.tensor([1, 2, 3])
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(1))

    def p_next(seq):
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)

    p1 = p_next(prompt.tolist())
    m2, m3 = torch.zeros(V), torch.zeros(V)
    for a in range(V):
        p2 = p_next(prompt.tolist() + [a])
        m2 += p1[a] * p2
        for b in range(V):
            m3 += p1[a] * p2[b] * p_next(prompt.tolist() + [a, b])
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    c2, c3 = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(N):
        out, st = dec.generate(prompt, make_drafter(), max_new_tokens=3, sampler=sampler, **generate_kw)
        c2[out[1]] += 1
        c3[out[2]] += 1
        accepted += sum(st.accepted_hist)
    chi2 = []
    for counts, m in ((c2, m2), (c3, m3)):
        keep = m * N >= 5
        exp = m[keep] * N
        chi2.append(float(((counts[keep] - exp) ** 2 / exp).sum()))
    return chi2, accepted


FIXED_Q = torch.tensor([0.4, 0.05, 0.05, 0.2, 0.1, 0.2])


def test_sample_rows_follows_each_row_and_never_draws_a_zero(monkeypatch):
    """The inverse-CDF sampler every token goes through (Sampler.sample, draw): frequencies match each row's p, a token
    of probability 0 is never drawn, rows need not be normalised, and a uniform draw that rounds up to the row's total
    gives the last token with mass."""
    from models.heads.drafting import sample_rows

    p = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 2.0, 0.0, 0.0, 6.0]])  # the second row unnormalised
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_rows(p, g) for _ in range(20000)])  # [20000, 2]
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=5).float() / draws.shape[0]
        exp = p[row] / p[row].sum()
        assert (freq[exp == 0] == 0).all()
        assert torch.allclose(freq, exp, atol=0.015), (freq, exp)
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))  # u = the total
    assert sample_rows(p, g).tolist() == [3, 4]
    assert Sampler(1.0, generator=g).sample(torch.tensor([0.1, 0.9, 0.0])) == 1


@pytest.mark.parametrize("with_probs", [True, False])
def test_sampling_matches_target_distribution(with_probs):
    """Chains from a fixed wrong q (with its distribution, or verified as one-hot) keep the target's marginals."""
    chi2, _ = sampled_marginals_chi2(lambda: FixedQ(FIXED_Q, with_probs), k=2)
    assert max(chi2) < 25.0, chi2  # df <= 5; p ≈ 1e-4 critical value


def test_bad_arguments(target):
    with pytest.raises(UserError, match="temperature"):
        Sampler(temperature=-0.5)
    with pytest.raises(UserError, match="k="):
        SpeculativeDecoder(target).generate(PROMPTS[0], NoDrafter(), k=-1)


def test_planner_math_and_tile_rule():
    from eval.planner import plan

    costs = [1.0, 1.1, 1.2, 1.5, 2.0]
    out = plan(costs, group=32, acceptance=[0.8, 0.5, 0.5, 0.5])
    assert out["tile_rule_max_d"] == 3 and out["verify_cost_ratio"][4] == 2.0
    assert out["predicted_tau"][:3] == [1.0, 1.8, 2.2]
    assert out["recommended_d"] <= 3 and out["bound_at_recommended_d"] == max(out["free_draft_speedup_bound"][:4])
    assert plan(costs, group=4, acceptance=None)["tile_rule_max_d"] == 31


def test_planner_measures_a_tiny_target():
    from eval.planner import verify_costs

    costs = verify_costs(tiny_model("llama"), max_d=3, context=8, reps=1, device="cpu")
    assert len(costs) == 4 and all(c > 0 for c in costs)


def test_a_tree_deeper_than_the_budget_never_emits_past_max_new_tokens(target):
    """A drafter may add nodes past the round's budget (LookupUnion's lookup branch): all accepted, the output still
    stops at exactly max_new_tokens."""
    from models.heads.trees import chain_parents

    class Overreach(Oracle):
        def propose(self, pending, k, sampler):
            toks = super().propose(pending, k + 6, sampler).tokens
            return Proposal(toks, None, chain_parents(toks.numel()))

    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ref = plain_greedy(target.model, PROMPTS[0], 7)
    out, st = dec.generate(PROMPTS[0], Overreach(target.model, 0.0), k=2, max_new_tokens=7)
    assert out == ref and st.new_tokens == 7
