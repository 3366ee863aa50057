"""Draft trees of every head in conf/draft/ (a new head is tested by adding its YAML file): lossless through the
decoder at T=0 and T=1, the shape the spec asks for, a topk=1 tree equal to the chain, and deep trees (several
parents per level, every level expanded) equal to the teacher-forced training forward on every path."""
from __future__ import annotations

import copy

import pytest
import torch

from eval.decoding.decoder import Proposal, Sampler, SpeculativeDecoder
from models.heads.trees import TreeSpec, chain_parents, node_depths, path_to
from test_decode_equals_train import perturbed, _tail
from test_decoder import PROMPTS, plain_greedy
from test_heads import DRAFT_CONFIGS


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_decodes_losslessly(cfg_path, temperature):
    target, head = perturbed(cfg_path)
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    spec = TreeSpec(budget=8, depth=3, topk=2)
    if temperature == 0:
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, tree=spec)
        assert out == plain_greedy(target.model, PROMPTS[1], 18)
    else:
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, sampler=sampler, tree=spec)
        assert len(out) == 18 and all(0 <= t < target.vocab_size for t in out)
    assert st.passes >= 1 and st.drafted > st.passes  # trees, not single tokens
    assert all(0 <= a <= spec.depth for a in st.accepted_hist)


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_tree_shape_follows_the_spec(cfg_path):
    """At most ``budget`` nodes, parents before children, at most ``topk`` children, no deeper than the spec or the
    head's own steps; q rows exactly when sampling."""
    target, head = perturbed(cfg_path)
    ids = PROMPTS[1]
    head.start(ids, target(ids[None]))
    for spec in (TreeSpec(budget=8, depth=3, topk=2), TreeSpec(budget=40, depth=20, topk=3)):
        for sampler in (Sampler(), Sampler(1.0, generator=torch.Generator().manual_seed(2))):
            prop = copy.deepcopy(head).propose_tree(5, spec, sampler)
            par = prop.parents.tolist()
            assert 1 <= len(par) <= spec.budget and all(p < i for i, p in enumerate(par))
            assert max(par.count(p) for p in set(par)) <= spec.topk
            assert int(node_depths(prop.parents).max()) <= spec.depth
            assert (prop.probs is None) == sampler.greedy


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_topk1_tree_is_the_chain(cfg_path):
    target, head = perturbed(cfg_path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (7,), generator=g)
    head.start(ids, target(ids[None]))
    for n_acc in (0, 2, 1, 3):
        pending, k = int(torch.randint(0, 128, (), generator=g)), min(head.num_steps, 4)
        chain = copy.deepcopy(head).propose(pending, k, Sampler())
        tree = head.propose_tree(pending, TreeSpec(budget=k, depth=k, topk=1), Sampler())
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert torch.equal(tree.parents, chain_parents(chain.tokens.numel()))
        block = torch.cat([torch.tensor([pending]), tree.tokens[:n_acc]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))


@pytest.mark.parametrize("prompt_len", [1, 9])
@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_deep_tree_nodes_equal_the_training_forward(cfg_path, prompt_len):
    """Every level expanded with two parents at the deepest one (budget = the whole expansion): each node's
    children are the training forward's top tokens on the node's path; committing any path keeps it so."""
    target, head = perturbed(cfg_path)
    depth = min(4, max(2, head.num_steps))  # a head trained on one step (EAGLE-1) still drafts deeper: test two levels
    spec = TreeSpec(budget=2 + (depth - 1) * 4, depth=depth, topk=2)
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, 128, (prompt_len,), generator=g)
    head.start(ids, target(ids[None]))
    for round_ in range(3):
        pending = int(torch.randint(0, 128, (), generator=g))
        tree = head.propose_tree(pending, spec, Sampler())
        par = tree.parents
        depths = node_depths(par)
        assert int(depths.max()) == spec.depth
        assert len({int(par[i]) for i in range(len(par)) if depths[i] == spec.depth}) == 2
        for parent in sorted(set(par.tolist())):
            kids = (par == parent).nonzero().flatten()
            path = path_to(parent, par) if parent >= 0 else []
            seq = torch.cat([ids, torch.tensor([pending]), tree.tokens[path]])
            tf = head.teacher_forced_logits(seq[None], target(seq[None]), ids.numel() - 1, len(path) + 1)[-1]
            assert tree.tokens[kids].tolist() == tf.topk(len(kids)).indices.tolist(), f"round {round_}, parent {parent}"
        path = path_to(len(par) - 1 - round_, par)
        block = torch.cat([torch.tensor([pending]), tree.tokens[path]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))


@pytest.mark.parametrize("packing", ["bfloat16", "fastest"])
@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_packed_draft_decodes_losslessly(cfg_path, packing):
    """A head whose linear layers are packed in bf16 (``load_head(..., linear_dtype="bfloat16")``), or each given
    the kernel timed fastest here at each row count (``linear_dtype="auto"``: MKL, MKL on a transposed copy, fp32 or
    bf16 packing; fused q/k/v and gate/up or not), drafts other logits in their last bits; greedy output still equals plain decoding, chain and tree."""
    from models.cpu_linear import PackedLinear, pack_fastest, pack_linears

    target, head = perturbed(cfg_path)
    n_linear = sum(type(m) is torch.nn.Linear for m in head.modules())
    if packing == "bfloat16":
        if not pack_linears(head, torch.bfloat16):
            pytest.skip("no oneDNN bf16 packed linear in this PyTorch build")
        assert any(isinstance(m, PackedLinear) and "bfloat16" in m.kinds for m in head.modules())
    else:
        counts = pack_fastest(head)
        if not counts:
            pytest.skip("no oneDNN packed linear in this PyTorch build")
        assert counts["replaced"] + counts["kept"] == n_linear
        assert sum(isinstance(m, PackedLinear) for m in head.modules()) == counts["replaced"]
        with torch.no_grad():  # whichever kernel won, each layer computes its own product
            for lin in (m for m in head.modules() if isinstance(m, torch.nn.Linear)):
                for rows in (1, 2, 3, 4, 8):  # each row count may have its own kernel (the layer's plan)
                    x = torch.randn(rows, lin.in_features)
                    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
                    assert torch.allclose(lin(x), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for tree in (None, TreeSpec(budget=8, depth=3, topk=2)):
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, tree=tree)
        assert out == plain_greedy(target.model, PROMPTS[1], 18) and st.passes >= 1


class _Fixed:
    """A drafter whose every proposal is the one given (a head's chain or tree, or a lookup's chain)."""

    def __init__(self, prop):
        self.prop = prop

    def start(self, prompt_ids, feats):
        pass

    def commit(self, tokens, feats):
        pass

    def propose(self, pending, k, sampler):
        return self.prop

    def propose_tree(self, pending, tree, sampler):
        return self.prop


def test_lookup_union_adds_the_lookup_branch_to_a_sampled_tree():
    """sampled_union: at T>0 the lookup's chain is walked from the root of the head's sampled tree, following the
    nodes that hold its tokens, the rest joining as point-mass nodes; by default the head drafts alone."""
    from eval.decoding.lookup import LookupUnion
    from eval.decoding.decoder import Proposal

    T = lambda *x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    tree = Proposal(T(10, 11, 12), torch.full((3, 16), 1 / 16), T(-1, -1, 0))
    spec, sampled = TreeSpec(budget=8, depth=3, topk=2), Sampler(1.0)

    def union(head, chain):
        return LookupUnion(_Fixed(head), _Fixed(Proposal(chain)), lookup_k=5, sampled_union=True).propose_tree(0, spec, sampled)

    p = union(tree, T(10, 12, 7))  # follows nodes 0 and 2, adds 7 below node 2
    assert p.tokens.tolist() == [10, 11, 12, 7] and p.parents.tolist() == [-1, -1, 0, 2] and p.usual
    assert p.point.tolist() == [False, False, False, True] and p.probs.shape == (4, 16)
    assert torch.equal(p.probs[:3], tree.probs) and not p.probs[3:].any()
    p = union(tree, T(5, 6))  # a new branch from the root
    assert p.tokens.tolist() == [10, 11, 12, 5, 6] and p.parents.tolist() == [-1, -1, 0, -1, 3]
    assert union(tree, T(10, 12)) is tree and union(tree, T()) is tree  # nothing new: the head's own proposal
    p = union(tree, T(3, 4, 5, 6))  # deeper than the head's tree: outside k=auto's estimates
    assert p.tokens.tolist() == [10, 11, 12, 3, 4, 5, 6] and not p.usual
    head_only = LookupUnion(_Fixed(tree), _Fixed(Proposal(T(3, 4))))
    assert head_only.propose_tree(0, spec, sampled) is tree  # by default: the head alone
    chain = Proposal(T(10, 11, 13), torch.full((3, 16), 1 / 16))
    p = LookupUnion(_Fixed(chain), _Fixed(Proposal(T(10, 4))), lookup_k=5, sampled_union=True).propose(0, 2, sampled)
    assert p.tokens.tolist() == [10, 11, 4] and p.parents.tolist() == [-1, 0, 0]  # the chain cut to k first
    from data.errors import UserError

    with pytest.raises(UserError, match="lookup_k=0"):
        LookupUnion(_Fixed(tree), _Fixed(Proposal(T(1))), lookup_k=0)


def test_lookup_union_drafts_the_lookup_alone_wherever_it_matches():
    """Greedy: the lookup alone wherever it matches (a one-branch tree that no k cuts, outside k=auto's estimates),
    the head where it does not, round after round."""
    from eval.decoding.lookup import LookupUnion

    T = lambda *x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    tree, spec, greedy = Proposal(T(10, 11, 12), None, T(-1, -1, 0)), TreeSpec(budget=8, depth=3, topk=2), Sampler()
    lookup = _Fixed(Proposal(T(5, 6, 7)))
    p = LookupUnion(_Fixed(tree), lookup, lookup_k=5).propose(0, 1, greedy)
    assert p.tokens.tolist() == [5, 6, 7] and p.parents.tolist() == [-1, 0, 1] and not p.usual
    u = LookupUnion(_Fixed(tree), _Fixed(Proposal(T())))
    for _ in range(2):
        assert u.propose_tree(0, spec, greedy) is tree  # no match: the head's own tree
        u.commit(T(0, 10), None)


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_head_with_lookup_decodes_losslessly(cfg_path):
    """Greedy output equals plain decoding, chain and tree, on a prompt that repeats (the lookup matches), and stops
    at exactly max_new_tokens although the lookup branch may reach past it; the head sits out the rounds the lookup
    drafts (it catches up at its next draft), and k=auto learns only from the rounds the head drafted."""
    from eval.decoding.autok import AutoK
    from eval.decoding.lookup import LookupUnion, NGramDrafter

    target, head = perturbed(cfg_path)
    prompt = torch.cat([PROMPTS[1], PROMPTS[1], PROMPTS[1][:4]])
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    want = plain_greedy(target.model, prompt, 17)

    class Counting(LookupUnion):
        grown = skipped = 0  # rounds in which the lookup added nodes to the head's proposal / drafted alone

        def _with_lookup(self, prop, *args):
            out = super()._with_lookup(prop, *args)
            self.grown += out is not prop
            return out

        def _look(self, *args):
            out = super()._look(*args)
            self.skipped += out is not None
            return out

    for tree in (None, TreeSpec(budget=6, depth=3, topk=2)):
        union = Counting(copy.deepcopy(head), NGramDrafter(3, 1), lookup_k=8)
        k = AutoK([1.0, 1.01, 1.02, 1.03], t1=1e6, learn_verify=False)
        out, st = dec.generate(prompt, union, k=k, max_new_tokens=17, tree=tree)
        assert out == want and len(out) == 17
        assert union.grown == 0 and union.skipped >= 1 and st.passes > union.skipped  # both drafted some rounds
        assert sum(rounds for _, rounds in k.nodes_seen.values()) == st.passes - union.skipped  # the head's rounds only
        # sampling: the lookup's branch joins the head's sampled draft as point masses (distribution: test_decoder_trees)
        union = Counting(copy.deepcopy(head), NGramDrafter(3, 1), lookup_k=8, sampled_union=True)
        out, st = dec.generate(prompt, union, k=3, max_new_tokens=17, tree=tree,
                               sampler=Sampler(1.0, generator=torch.Generator().manual_seed(0)))
        assert len(out) == 17 and union.grown >= 1 and union.skipped == 0
