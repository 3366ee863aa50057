"""Tree drafts in the one decoder: growth rules, greedy output identical to plain decoding whatever the tree holds,
the accepted path's K/V compacted exactly, a chain given as a tree identical to the chain path, and sampling
that keeps the target's distribution (recursive rejection over siblings; chi-square as for chains)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from eval.decoding.decoder import Proposal, Sampler, SpeculativeDecoder, accept_tree, keep_rows
from models.heads.trees import TreeSpec, ancestors, chain_parents, children, grow_tree, node_depths, path_to, tree_mask
from models.target import FrozenTarget
from test_decoder import FIXED_Q, PROMPTS, FixedQ, Oracle, plain_greedy, sampled_marginals_chi2


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(model=tiny_model("llama", layers=4), tap_layers=[1, 2, 3])


class OracleTree(Oracle):
    """Mock tree drafter: at each depth the target's own greedy token and ``width − 1`` wrong siblings, the right one
    at a random sibling rank (or missing with probability ``p_wrong``); only the right node is expanded further,
    plus one wrong branch so that rejected subtrees exist."""

    def __init__(self, model, p_wrong: float, width: int = 3, depth: int = 4, seed: int = 0):
        super().__init__(model, p_wrong, seed)
        self.width, self.depth = width, depth

    def propose(self, pending, k, sampler):
        raise AssertionError("the decoder must call propose_tree when a tree is asked for")

    def propose_tree(self, pending, tree, sampler):
        V = self.model.config.vocab_size
        cont = plain_greedy(self.model, torch.tensor(self.known + [pending]), min(self.depth, tree.depth))
        tokens, parents, parent = [], [], -1
        for t in cont:
            right = float(torch.rand((), generator=self.g)) >= self.p_wrong
            rank = int(torch.randint(0, self.width, (), generator=self.g))
            sib = [(t + 1 + j) % V for j in range(self.width)]
            if right:
                sib[rank] = t
            first = len(tokens)
            for s in sib:
                tokens.append(s)
                parents.append(parent)
            if first + (0 if rank else 1) < len(tokens):  # a wrong branch gets one child too
                wrong = first + (1 if rank == 0 else 0)
                tokens.append((t + 7) % V)
                parents.append(wrong)
            if not right:
                break
            parent = first + rank
        return Proposal(torch.tensor(tokens), None, torch.tensor(parents))


def test_tree_helpers():
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    assert node_depths(parents).tolist() == [1, 1, 2, 2, 3, 2]
    assert path_to(4, parents) == [0, 2, 4] and path_to(-1, parents) == []
    anc = ancestors(parents)
    assert anc[4].nonzero().flatten().tolist() == [0, 2, 4] and anc[5].nonzero().flatten().tolist() == [1, 5]
    m = tree_mask(parents, past=3)  # [1+6, 3+1+6]
    assert m.shape == (7, 10) and m[:, :4].all()
    assert m[5, 4:].tolist() == [True, False, True, False, True, False]  # node 4 (row 5) sees nodes 0, 2 and itself
    assert chain_parents(3).tolist() == [-1, 0, 1]


@pytest.mark.parametrize("greedy", [True, False])
def test_grow_tree_respects_budget_depth_and_order(greedy):
    V = 50
    g = torch.Generator().manual_seed(0)
    table = torch.randn(64, V, generator=g) * 3
    sampler = Sampler() if greedy else Sampler(1.0, generator=torch.Generator().manual_seed(1))
    calls = []

    def expand(nodes, tokens, parents):
        calls.append(list(nodes))
        assert tokens.numel() == parents.numel() > max(nodes)
        return table[torch.tensor(nodes) % 64]

    for spec in (TreeSpec(budget=10, depth=3, topk=2), TreeSpec(budget=5, depth=8, topk=1), TreeSpec(budget=30, depth=4, topk=4)):
        calls.clear()
        prop = grow_tree(table[63], expand, spec, sampler)
        n = prop.tokens.numel()
        par = prop.parents.tolist()
        assert 1 <= n <= spec.budget and all(p < i for i, p in enumerate(par))
        assert int(node_depths(prop.parents).max()) <= spec.depth
        assert all(sum(1 for p in par if p == q) <= spec.topk for q in set(par))
        assert all(len(c) <= spec.topk for c in calls)  # expanded nodes per level
        if spec.topk == 1:
            assert par == chain_parents(n).tolist() and n == min(spec.budget, spec.depth)
        if greedy:  # the root's children are its top-k, best first
            kids = [i for i, p in enumerate(par) if p == -1]
            assert prop.tokens[kids].tolist() == torch.softmax(table[63], -1).topk(len(kids)).indices.tolist()
        else:
            assert prop.probs.shape == (n, V)


@pytest.mark.parametrize("peak", [0.0, 4.0, 12.0])
def test_greedy_tree_stops_growing_when_no_deeper_node_can_make_the_cut(peak):
    """The greedy tree equals EAGLE-2's re-ranking of the full top-k expansion (computed here from the logits), while
    levels whose nodes could not enter the best ``budget`` are not expanded."""
    V = 40
    g = torch.Generator().manual_seed(int(peak))
    table = torch.randn(64, V, generator=g) * 2
    table[:, 7] += peak  # a confident draft: one token far ahead, so deep chains outrank late siblings
    calls = []

    def expand(nodes, tokens, parents):
        calls.append(len(nodes))
        return table[torch.tensor(nodes) % 64]

    fewer = 0
    for spec in (TreeSpec(budget=16, depth=16, topk=2), TreeSpec(budget=16, depth=10, topk=2),
                 TreeSpec(budget=10, depth=6, topk=3), TreeSpec(budget=5, depth=8, topk=1)):
        cap = spec.topk + (spec.depth - 1) * spec.topk ** 2
        calls.clear()
        full = grow_tree(table[63], expand, TreeSpec(budget=cap, depth=spec.depth, topk=spec.topk), Sampler())
        levels_full = len(calls)
        logp = []  # the full expansion's nodes in growth order; each node's logits are table[node % 64]
        for tok, par in zip(full.tokens.tolist(), full.parents.tolist()):
            row = table[63] if par < 0 else table[par % 64]
            logp.append((0.0 if par < 0 else logp[par]) + math.log(float(torch.softmax(row, -1)[tok])))
        best = sorted(sorted(range(len(logp)), key=lambda n: (-logp[n], n))[: spec.budget])
        index = {old: i for i, old in enumerate(best)}
        calls.clear()
        prop = grow_tree(table[63], expand, spec, Sampler())
        assert prop.tokens.tolist() == [full.tokens[n].item() for n in best]
        assert prop.parents.tolist() == [-1 if full.parents[n] < 0 else index[int(full.parents[n])] for n in best]
        assert len(calls) <= levels_full
        fewer += len(calls) < levels_full
    assert fewer > 0  # the stop happens in these trees


def test_min_prob_stops_expanding_unlikely_nodes():
    V = 20
    peaked = torch.full((V,), -10.0)
    peaked[3] = 10.0
    flat = torch.zeros(V)
    for logits, deep in ((peaked, True), (flat, False)):
        prop = grow_tree(logits, lambda nodes, *_: logits.expand(len(nodes), V), TreeSpec(budget=8, depth=6, topk=1, min_prob=0.2), Sampler())
        assert (prop.tokens.numel() == 6) == deep  # flat: 1/20 < 0.2 after the first node, nothing expanded
        if not deep:
            assert prop.tokens.numel() == 1


def test_children_without_replacement():
    q_logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    toks, probs, q = children(q_logits, 4, Sampler(1.0, generator=torch.Generator().manual_seed(0)))
    assert len(set(toks)) == 4 and 4 not in toks and q[4] == 0  # never a token without mass
    toks, _, q = children(q_logits, 3, Sampler())
    assert toks == [0, 1, 2] and q is None


@pytest.mark.parametrize("p_wrong", [0.0, 0.5, 1.0])
def test_greedy_tree_equals_plain(target, p_wrong):
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for prompt in PROMPTS:
        ref = plain_greedy(target.model, prompt, 20)
        out, st = dec.generate(prompt, OracleTree(target.model, p_wrong), max_new_tokens=20, tree=TreeSpec(16, 4, 3))
        assert out == ref and st.new_tokens == 20
        if p_wrong == 0.0:  # the right path is always in the tree: depth + bonus per pass, budget aside
            assert max(st.accepted_hist) == 4 and st.verified_tokens / st.passes > 3
        if p_wrong == 1.0:
            assert sum(st.accepted_hist) == 0


def test_eos_and_budget_inside_a_tree(target):
    prompt = PROMPTS[0]
    ref = plain_greedy(target.model, prompt, 30)
    dec = SpeculativeDecoder(target, eos_token_ids=[ref[6]])
    out, _ = dec.generate(prompt, OracleTree(target.model, 0.0), max_new_tokens=30, tree=TreeSpec(16, 4, 3))
    assert out == ref[: ref.index(ref[6]) + 1]
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for budget in (1, 2, 7, 11):
        out, st = dec.generate(prompt, OracleTree(target.model, 0.0), max_new_tokens=budget, tree=TreeSpec(16, 4, 3))
        assert out == ref[:budget] and st.new_tokens == budget


def test_accepted_path_kv_equals_a_chain_forward(target):
    """After verifying a tree whose accepted path sits on later siblings, the compacted cache holds what a plain
    forward of that path would have written."""
    prompt = PROMPTS[1].view(1, -1)
    cont = plain_greedy(target.model, PROMPTS[1], 3)
    V = target.vocab_size
    # pending = cont[0]; tree: two wrong siblings before the right one at each of two depths
    tokens = [(cont[1] + 1) % V, (cont[1] + 2) % V, cont[1], (cont[2] + 1) % V, cont[2]]
    parents = torch.tensor([-1, -1, -1, 2, 2])
    cache = DynamicCache()
    target(prompt, cache=cache, use_cache=True)
    past = prompt.shape[1]
    block = torch.tensor([[cont[0]] + tokens])
    mask = torch.zeros(1 + 5, past + 6).masked_fill_(~tree_mask(parents, past), float("-inf"))
    pos = past + torch.cat([torch.zeros(1, dtype=torch.long), node_depths(parents)])[None]
    out = target(block, attention_mask=mask[None, None], position_ids=pos, cache=cache, use_cache=True)
    logits = target.model.lm_head(out.last_state)[0]
    path, nxt = accept_tree(block[0, 1:], parents, None, logits, Sampler())
    assert path == [2, 4]
    keep_rows(cache, past, [0, 3, 5])
    ref = DynamicCache()
    target(torch.cat([prompt, torch.tensor([[cont[0], cont[1], cont[2]]])], 1), cache=ref, use_cache=True)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


class AsTree:
    """Wraps a chain drafter: the same proposal, given as a tree with one child per node."""

    def __init__(self, inner):
        self.inner = inner

    def start(self, p, f):
        self.inner.start(p, f)

    def commit(self, t, f):
        self.inner.commit(t, f)

    def propose(self, pending, k, sampler):
        raise AssertionError("propose_tree expected")

    def propose_tree(self, pending, tree, sampler):
        prop = self.inner.propose(pending, tree.depth, sampler)
        return Proposal(prop.tokens, prop.probs, chain_parents(prop.tokens.numel()))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chain_given_as_a_tree_is_the_chain(target, temperature):
    q = torch.softmax(torch.randn(target.vocab_size, generator=torch.Generator().manual_seed(2)) * 2, -1)
    dec = SpeculativeDecoder(target, eos_token_ids=[])

    def run(drafter, **kw):
        sampler = Sampler(temperature, generator=torch.Generator().manual_seed(4))
        torch.manual_seed(0)
        return dec.generate(PROMPTS[1], drafter, max_new_tokens=24, sampler=sampler, **kw)

    for inner in (lambda: Oracle(target.model, 0.3), lambda: FixedQ(q)):
        if temperature == 0 or isinstance(inner(), FixedQ):
            a, sa = run(inner(), k=3)
            b, sb = run(AsTree(inner()), tree=TreeSpec(budget=3, depth=3, topk=1))
            assert a == b and sa.accepted_hist == sb.accepted_hist


class FixedQTree(FixedQ):
    """Mock tree drafter: every node's children drawn without replacement from one fixed q (2 per node, depth 2)."""

    def propose_tree(self, pending, tree, sampler):
        logits = self.q.log()
        prop = grow_tree(logits, lambda nodes, *_: logits.expand(len(nodes), -1), TreeSpec(budget=6, depth=min(2, tree.depth), topk=2), sampler)
        return prop if self.with_probs else Proposal(prop.tokens, None, prop.parents)


class _PointChain:
    """A lookup that always proposes the same chain (point masses)."""

    def __init__(self, chain):
        self.chain = chain
        self.proposals = 0

    def start(self, p, f):
        pass

    def commit(self, t, f):
        pass

    def propose(self, pending, k, sampler):
        self.proposals += 1
        return Proposal(torch.tensor(self.chain[:k], dtype=torch.long))


def test_a_point_mass_sibling_is_tried_after_the_sampled_ones():
    """accept_tree with ``point``: a sampled sibling the target never picks is rejected, then the point-mass sibling
    is accepted with the target's probability of its token (here 1/2, where read as drawn from q it would always be),
    the walk goes on below it, and otherwise the next token comes from what is left (the other half)."""
    V = 5
    q = torch.zeros(3, V)
    q[0, 0] = 1.0  # node 0 drawn from q (all mass on token 0)
    logits = torch.full((4, V), -30.0)
    logits[0, 2] = logits[0, 1] = 30.0  # the target at the root: tokens 1 and 2, half each
    logits[2, 4] = 30.0  # after node 1 (token 2): token 4 = node 2's token
    logits[3, 3] = 30.0
    draft, parents = torch.tensor([0, 2, 4]), torch.tensor([-1, -1, 1])
    point = torch.tensor([False, True, True])
    g = torch.Generator().manual_seed(0)
    outcomes = [accept_tree(draft, parents, q, logits, Sampler(1.0, generator=g), point) for _ in range(2000)]
    taken = sum(path == [1, 2] and nxt == 3 for path, nxt in outcomes)
    assert all((path, nxt) in (([1, 2], 3), ([], 1)) for path, nxt in outcomes)
    assert 0.45 < taken / 2000 < 0.55, taken


@pytest.mark.parametrize("chain", [[3, 0], [2, 5]])
def test_a_lookup_branch_beside_a_sampled_tree_keeps_the_target_distribution(chain, monkeypatch):
    """LookupUnion at T>0: the head's tree drawn from q, the lookup's chain joined as point-mass nodes (merged where
    the head drew the same token); chi-square as for sampled trees, with point-mass nodes really accepted."""
    import eval.decoding.decoder
    from eval.decoding.lookup import LookupUnion

    through_point = []
    real = eval.decoding.decoder.accept_tree

    def counting(draft, parents, q, logits, sampler, point=None):
        path, nxt = real(draft, parents, q, logits, sampler, point)
        through_point.append(point is not None and any(bool(point[i]) for i in path))
        return path, nxt

    monkeypatch.setattr(eval.decoding.decoder, "accept_tree", counting)
    chi2, accepted = sampled_marginals_chi2(lambda: LookupUnion(FixedQTree(FIXED_Q), _PointChain(chain), lookup_k=2,
                                                                      sampled_union=True),
                                            tree=TreeSpec(6, 2, 2))
    assert len(through_point) == 3000 and sum(through_point) > 100, sum(through_point)
    assert max(chi2) < 25.0, chi2


@pytest.mark.parametrize("with_probs", [True, False])
def test_tree_sampling_matches_target_distribution(with_probs):
    """As test_decoder's chi-square test, with trees of two children per node: recursive rejection over siblings
    (q with earlier siblings removed; one-hot q without distributions) keeps the target's marginals."""
    chi2, accepted = sampled_marginals_chi2(lambda: FixedQTree(FIXED_Q, with_probs), tree=TreeSpec(6, 2, 2))
    assert accepted > 3000 * 0.3  # the trees are really used
    assert max(chi2) < 25.0, chi2


def test_auto_k_is_lossless_and_follows_acceptance(target):
    """k=auto (eval.decoding.autok.AutoK) keeps greedy output identical and drafts long where drafts are always right,
    short where they are always wrong."""
    from eval.decoding.autok import AutoK

    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ratio = [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4]
    for p_wrong, long in ((0.0, True), (1.0, False)):
        auto = AutoK(ratio, t1=1e6, learn_verify=False)  # T(1) so long that the mock's own draft time (a full forward per
        # token) counts as free; the curve is kept as given (learnt from the mock's real verify seconds, it would be ~0)
        for prompt in PROMPTS:
            out, st = dec.generate(prompt, Oracle(target.model, p_wrong), k=auto, max_new_tokens=40)
            assert out == plain_greedy(target.model, prompt, 40)
        common = max(set(auto.chosen), key=auto.chosen.count)
        assert (common >= 4) if long else (auto.chosen[-10:] == [1] * 10), auto.chosen


def test_auto_k_stays_within_the_drafters_longest_draft(target):
    """A drafter that drafts at most ``max_draft`` tokens (MTP: one per module; a block drafter: its block) is never
    asked for more by k=auto, where always-right drafts and a cheap verify curve would otherwise choose longer."""
    from eval.decoding.autok import AutoK

    class Short(Oracle):
        max_draft = 2

        def propose(self, pending, k, sampler):
            return super().propose(pending, min(k, self.max_draft), sampler)

    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ratio = [1.0 + 0.01 * i for i in range(9)]
    for cap, drafter in ((2, Short(target.model, 0.0)), (8, Oracle(target.model, 0.0))):
        auto = AutoK(ratio, t1=1e6, learn_verify=False)
        for prompt in PROMPTS:
            out, _ = dec.generate(prompt, drafter, k=auto, max_new_tokens=30)
            assert out == plain_greedy(target.model, prompt, 30)
        assert max(auto.chosen) == cap, auto.chosen


@pytest.mark.parametrize("explore", [True, False])
def test_auto_k_recovers_from_unlucky_early_rounds(explore):
    """A drafter whose every position is accepted with probability 0.8, after three early rounds in which position
    2 was rejected: choosing for the posterior means stays at k=1 (position 2 is never reached again, so its
    estimate is never corrected); Thompson draws keep trying it and settle on the best k for the true rates."""
    import random

    from eval.decoding.autok import AutoK

    ratio = [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6]  # T(1+d)/T(1), a CPU-like verify curve
    true = AutoK(ratio, t1=1.0, explore=False, learn_verify=False)
    true.reached, true.accepted = [10**6] * true.max_k, [8 * 10**5] * true.max_k  # the true rates, known exactly
    true.update(reached=0, accepted=0, draft_s=0.1, drafted=1)  # 0.1 T(1) per drafted token
    best = max(range(1, true.max_k + 1), key=true.value)
    assert best == 4  # by hand: (1 + .8 + .64 + .512 + .41) / (1.2 + 4 x 0.1) = 2.10, above k = 3 (2.04) and k = 5 (2.05)
    auto = AutoK(ratio, t1=1.0, explore=explore, learn_verify=False)
    for _ in range(3):
        auto.update(reached=2, accepted=1, draft_s=0.2, drafted=2)
    rng = random.Random(1)
    for _ in range(600):
        k = auto.choose(limit=8)
        n = next((i for i in range(k) if rng.random() >= 0.8), k)  # drafts accepted before the first rejection
        auto.update(reached=k, accepted=n, draft_s=0.1 * k, drafted=k)
    late = auto.chosen[-200:]
    common = max(set(late), key=late.count)
    if explore:
        assert common == best and late.count(best) > 100, late
    else:
        assert late == [1] * 200  # the trap the draws avoid


def test_auto_k_fits_a_fixed_and_a_per_token_draft_cost():
    """k=auto's draft cost per round is c0 + k·c fitted over the rounds (a block drafter's one forward, or the
    commit after each verify, is paid once a round whatever k): with one length tried it is all per token; with
    several the fit recovers both parts, and the choice follows the affine cost, not the per-token average."""
    from eval.decoding.autok import AutoK

    ratio = [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6]
    auto = AutoK(ratio, t1=0.01, learn_verify=False)
    for _ in range(5):
        auto.update(reached=2, accepted=1, draft_s=0.004 + 2 * 0.0001, drafted=2)  # 0.4 T(1) a round + 0.01 T(1) a token
    assert auto.round_cost(6) == pytest.approx(6 * 0.21)  # one length seen: proportional, as before
    for k in (1, 4, 8, 3):
        auto.update(reached=k, accepted=0, draft_s=0.004 + k * 0.0001, drafted=k)
    assert [auto.round_cost(k) for k in (1, 6)] == pytest.approx([0.41, 0.46])
    auto.reached, auto.accepted = [10**6] * 8, [9 * 10**5] * 8  # acceptance 0.9 at every position, known exactly
    assert max(range(1, 9), key=auto.value) == 8  # 6.13 / (1.6 + 0.48) = 2.95; the per-token average (0.148 T(1)) says k = 5
    flat = AutoK(ratio, t1=0.01, explore=False, learn_verify=False)
    flat.update(reached=0, accepted=0, draft_s=auto.fit[3], drafted=int(auto.fit[1]))  # the same totals as one round: per token
    flat.reached, flat.accepted = auto.reached, auto.accepted
    assert max(range(1, 9), key=flat.value) < 8


def test_auto_k_cost_ignores_rare_slow_rounds_and_each_prompts_first(target):
    """The cost fit runs through each length's median: a few slow rounds at k=3 (catch-up work, such as MTP's deeper
    depths after a stretch at k=1) leave c0 + k·c where the usual rounds put it, where a least-squares sum over
    every round took them as the price of k=3. The decoder leaves each prompt's first round (which also reads the
    prompt) out of the fit."""
    from eval.decoding.autok import AutoK

    ratio = [1.0, 1.05, 1.1, 1.15, 1.2]
    auto = AutoK(ratio, t1=1.0)
    for _ in range(20):
        auto.update(reached=1, accepted=1, draft_s=0.1, drafted=1)
        auto.update(reached=3, accepted=3, draft_s=0.3, drafted=3)
    for _ in range(4):
        auto.update(reached=3, accepted=3, draft_s=3.0, drafted=3)  # 4 of 24 rounds at k=3 ten times slower
    assert [auto.round_cost(k) for k in (1, 3)] == pytest.approx([0.1, 0.3])
    ignored = AutoK(ratio, t1=1.0)
    ignored.update(reached=3, accepted=3, draft_s=3.0, drafted=3, timed=False)
    assert ignored.fit == [0.0] * 5 and ignored.reached[:3] == [1, 1, 1]  # acceptance still counts
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    auto = AutoK(ratio, t1=1.0)
    passes = sum(dec.generate(p, Oracle(target.model, 0.0), k=auto, max_new_tokens=12)[1].passes for p in PROMPTS[:2])
    assert sum(len(t) for t in auto.times.values()) == passes - 2


@pytest.mark.parametrize("learn", [True, False])
def test_auto_k_learns_the_verify_curve_while_decoding(learn):
    """A start curve with a step at d >= 3 (as one evaluation's was: 1.18 where its neighbours read about 1.05) holds
    k=auto at 2 drafted tokens when kept point by point; as a line refitted to each round's verify seconds (noisy,
    as rounds are), k=auto settles on the best length for the true curve."""
    import random

    from eval.decoding.autok import AutoK

    true = [1.0 + 0.06 * d for d in range(9)]  # T(1+d)/T(1) while decoding
    start = [1.0, 1.06, 1.12, 1.45, 1.55, 1.6, 1.65, 1.7, 1.75]
    t1, a = 0.01, 0.7
    known = AutoK(true, t1=t1, explore=False)
    known.reached, known.accepted = [10**6] * known.max_k, [7 * 10**5] * known.max_k
    best = max(range(1, known.max_k + 1), key=known.value)
    assert best == 5  # no draft cost: (1 + .7 + ... + .7^5) / 1.30 = 2.26; k = 4: 2.24, k = 6: 2.25
    auto = AutoK(start, t1=t1, learn_verify=learn)
    rng = random.Random(0)
    for _ in range(800):
        k = auto.choose(limit=8)
        n = next((i for i in range(k) if rng.random() >= a), k)
        noise = rng.uniform(0.85, 1.15) * (10.0 if rng.random() < 0.05 else 1.0)  # jitter, and a disturbed round in 20
        auto.update(reached=k, accepted=n, draft_s=0.0, drafted=k, verify_s=t1 * true[k] * noise)
    late = auto.chosen[-300:]
    common = max(set(late), key=late.count)
    if learn:
        assert abs(common - best) <= 1 and late.count(common) > 100, late
        assert auto.curve[1:] == pytest.approx(true[1:], rel=0.05)
    else:
        assert common == 2, late


def test_auto_k_verify_line_through_the_start_curve_and_the_rounds():
    """The verify cost is a line α + β·d (d >= 1) through the start curve (``PRIOR_WEIGHT`` rounds a point) and each
    verified size's median (its rounds); β is never negative; a prompt's first round stays out."""
    from eval.decoding.autok import AutoK

    auto = AutoK([1.0, 1.1, 1.2, 1.3], t1=1.0)
    assert auto.curve == pytest.approx([1.0, 1.1, 1.2, 1.3])  # on a line already
    bumped = AutoK([1.0, 1.1, 1.5, 1.3], t1=1.0)
    assert bumped.curve == pytest.approx([1.0, 1.2, 1.3, 1.4])  # one bad point moves the line, not just its own size
    w = AutoK.PRIOR_WEIGHT
    for _ in range(AutoK.MIN_VERIFY - 1):
        auto.update(reached=1, accepted=1, draft_s=0.0, drafted=1, verify_s=5.0)
    assert auto.curve == pytest.approx([1.0, 1.1, 1.2, 1.3])  # too few rounds at d = 1 to count
    auto.verify_times.clear()
    for _ in range(3 * w):
        auto.update(reached=2, accepted=1, draft_s=0.0, drafted=2, verify_s=2.0)
        auto.update(reached=3, accepted=1, draft_s=0.0, drafted=3, verify_s=[2.0, 2.3, 2.1][_ % 3])  # median 2.1
    # points (1, 1.1) x w, (2, 1.2) x w, (3, 1.3) x w, (2, 2.0) x 3w, (3, 2.1) x 3w: least squares by hand
    xs = [1] * w + [2] * w + [3] * w + [2] * 3 * w + [3] * 3 * w
    ys = [1.1] * w + [1.2] * w + [1.3] * w + [2.0] * 3 * w + [2.1] * 3 * w
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert auto.curve == pytest.approx([1.0] + [my + beta * (d - mx) for d in (1, 2, 3)])
    before = list(auto.curve)
    auto.update(reached=1, accepted=1, draft_s=0.0, drafted=1, verify_s=9.0, timed=False)  # a prompt's first round
    assert auto.curve == before
    falling = AutoK([1.0, 1.3, 1.2, 1.1], t1=1.0)
    assert falling.curve == pytest.approx([1.0, 1.2, 1.2, 1.2])  # β clipped at 0: the mean
    fixed = AutoK([1.0, 1.1, 1.5, 1.3], t1=1.0, learn_verify=False)
    fixed.update(reached=1, accepted=1, draft_s=0.0, drafted=1, verify_s=2.2)
    assert fixed.curve == [1.0, 1.1, 1.5, 1.3]


def test_auto_depth_trees_are_lossless_and_follow_acceptance(target):
    """k=auto with a tree: k is the tree's depth, chosen every round against the verify cost at the node count
    measured for that depth (before any round: what the budget and top-k allow); greedy output stays identical."""
    from eval.decoding.autok import AutoK

    spec = TreeSpec(budget=16, depth=4, topk=3)
    ratio = [1.0 + 0.05 * i for i in range(17)]
    fresh = AutoK(ratio, t1=1.0, tree=spec)
    assert fresh.max_k == 4 and [fresh.nodes(k) for k in (1, 2, 3)] == [3, 12, 16]
    assert fresh.verify_ratio(2.5) == pytest.approx(1.125) and fresh.verify_ratio(40) == ratio[-1]
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    flat = [1.0 + 0.01 * i for i in range(17)]  # a GPU-like verify curve: deep trees cost little more than shallow ones
    for p_wrong, long, curve in ((0.0, True, flat), (1.0, False, ratio)):
        auto = AutoK(curve, t1=1e6, tree=spec, learn_verify=False)  # draft time counts as free (see the chain test above)
        for prompt in PROMPTS:
            out, st = dec.generate(prompt, OracleTree(target.model, p_wrong, width=3, depth=4), k=auto, max_new_tokens=40, tree=spec)
            assert out == plain_greedy(target.model, prompt, 40)
        common = max(set(auto.chosen), key=auto.chosen.count)
        assert (common >= 3) if long else (auto.chosen[-10:] == [1] * 10), auto.chosen
        total, rounds = auto.nodes_seen[common]
        assert rounds > 0 and auto.nodes(common) == total / rounds and 3 <= auto.nodes(common) <= 4 * common


def test_eval_drafter_entries_take_tree_and_k(target):
    """conf/eval.yaml drafters: ``tree:`` and ``k:`` keys per entry; user mistakes are one clear line."""
    from data.errors import UserError
    from eval.decoding.drafters import build_drafter

    ngram = {"_target_": "eval.decoding.lookup.NGramDrafter", "max_ngram": 3}
    d = build_drafter({**ngram, "k": "auto"}, target, "ngram")
    assert d.draft_k == "auto" and not hasattr(d, "tree_spec")
    with pytest.raises(UserError, match="drafters.ngram.tree: NGramDrafter drafts chains only"):
        build_drafter({**ngram, "tree": {"budget": 8}}, target, "ngram")
    with pytest.raises(UserError, match="drafters.ngram.k=0"):
        build_drafter({**ngram, "k": 0}, target, "ngram")
