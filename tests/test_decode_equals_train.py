"""Decoding equals training, for every draft config in conf/draft/ (a new head is tested by adding its YAML file).

After ``start`` and any number of ``commit`` rounds (accepted prefixes of every length; some rounds with no ``propose``
before their ``commit``, as when another drafter drafted them), what ``propose`` drafts is
what the head's teacher-forced training forward gives at the same positions with the drafts as the following
tokens: the same tokens at T=0 and the same distributions at T=1 (``DraftHead.teacher_forced_logits``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from eval.decoding.decoder import Sampler
from models.target import TargetOutput
from test_heads import DRAFT_CONFIGS, make_head


def perturbed(cfg_path, **over):
    """A head whose every weight is random (zero-initialised parts included), with a reduced draft vocabulary
    where the family has one, so that no path of propose is trivially the identity; ``over``: config overrides."""
    over = {"draft_vocab_size": 96, **over} if "draft_vocab_size" in OmegaConf.load(cfg_path) else over
    target, head = make_head(cfg_path, **over)
    head.prepare_from_data(torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(7)))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return target, head


def _tail(target, ids, n):
    """Target features of the last n tokens of ``ids`` (what the decoder commits after a round)."""
    out = target(ids[None])
    return TargetOutput(tap_states=out.tap_states[:, -n:], last_state=out.last_state[:, -n:])


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_propose_equals_the_teacher_forced_training_forward(cfg_path):
    check_decode_equals_train(*perturbed(cfg_path))


def check_decode_equals_train(target, head) -> None:
    """The body of the test above, for a head built any way (tests of a family's options call it too)."""
    K = head.num_steps
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (9,), generator=g)
    head.start(ids, target(ids[None]))
    accepted_lengths = set()
    for round_, k in enumerate([K, 1, K + 2, 3, K, 2, K, K]):
        pending = int(torch.randint(0, 128, (), generator=g))
        if round_ in (2, 3, 6):  # a round another drafter drafted (eval.decoding.lookup.LookupUnion): commit, no propose
            block = torch.cat([torch.tensor([pending]), torch.randint(0, 128, (round_ % 3,), generator=g)])
            ids = torch.cat([ids, block])
            head.commit(block, _tail(target, ids, block.numel()))
            continue
        at = ids.numel() - 1  # last committed position; the pending token sits at at+1
        # T=1 on a copy: the distributions drafted from equal softmax(training logits) with the samples as the following tokens
        sampled = copy.deepcopy(head).propose(pending, k, Sampler(1.0, generator=torch.Generator().manual_seed(round_)))
        s = sampled.tokens
        assert 1 <= s.numel() <= k
        seq = torch.cat([ids, torch.tensor([pending]), s])
        tf = head.teacher_forced_logits(seq[None], target(seq[None]), at, s.numel())
        assert sampled.probs is not None and sampled.probs.shape == tf.shape
        torch.testing.assert_close(sampled.probs.float(), torch.softmax(tf, -1), atol=2e-5, rtol=1e-4)
        # T=0 on the head itself: the drafted tokens are the training forward's argmax
        drafts = head.propose(pending, k, Sampler()).tokens
        assert 1 <= drafts.numel() <= min(k, head.max_draft or k)
        seq = torch.cat([ids, torch.tensor([pending]), drafts])
        tf = head.teacher_forced_logits(seq[None], target(seq[None]), at, drafts.numel())
        assert tf.argmax(-1).tolist() == drafts.tolist(), f"round {round_}: decode {drafts.tolist()} != train {tf.argmax(-1).tolist()}"
        n = round_ % (drafts.numel() + 1)  # accept 0, 1, 2, ... drafts
        accepted_lengths.add(n)
        block = torch.cat([torch.tensor([pending]), drafts[:n]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))
    assert len(accepted_lengths) >= 3


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_untrained_head_starts_from_the_target(cfg_path):
    """Every token-predicting output starts as the target's own head: its rows of the head's vocabulary (EAGLE-3's
    draft vocabulary, chosen again by prepare_from_data), and the target's final norm where the head has one."""
    over = {"draft_vocab_size": 96} if "draft_vocab_size" in OmegaConf.load(cfg_path) else {}
    target, head = make_head(cfg_path, **over)
    W = target.lm_head().weight.detach().float()
    counts = torch.randint(0, 1000, (W.shape[0],), generator=torch.Generator().manual_seed(7))
    head.prepare_from_data(counts)
    if hasattr(head, "draft_head"):  # MTP: the target's whole head, and its draft-vocabulary rows for decoding
        assert torch.equal(head.lm_head.weight, W) and torch.equal(head.draft_head.weight, W[head.draft_ids()])
    else:
        rows = head.draft_ids() if hasattr(head, "draft_ids") else torch.arange(W.shape[0])
        heads = getattr(head, "heads", None) or [head.lm_head]  # Medusa: one output head per step
        for lin in heads:
            assert torch.equal(lin.weight, W[rows])
    final = target.model.model.norm.weight.float()
    for name, m in head.named_modules():
        if name == "norm" or name.endswith(".norm"):
            assert torch.equal(m.weight, final), name


def test_eagle3_freeze_lm_head():
    cfg = next(p for p in DRAFT_CONFIGS if p.stem == "eagle3")
    _, head = make_head(cfg, draft_vocab_size=96)
    assert head.lm_head.weight.requires_grad
    _, frozen = make_head(cfg, draft_vocab_size=96, freeze_lm_head=True)
    assert not frozen.lm_head.weight.requires_grad and "lm_head.weight" not in {n for n, p in frozen.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("cfg_path", DRAFT_CONFIGS, ids=lambda p: p.stem)
def test_tree_nodes_equal_the_teacher_forced_training_forward(cfg_path):
    """``propose_tree`` (every family that drafts trees): each node's siblings are the top tokens (T=0) of the
    training forward teacher-forced on the node's path, and at T=1 their q is its softmax; committing a path of
    the tree leaves the head where committing that chain would (later proposals still equal training)."""
    target, head = perturbed(cfg_path)
    if not hasattr(head, "propose_tree"):
        pytest.skip(f"{cfg_path.stem} drafts chains only")
    check_tree_equals_train(target, head)


def check_tree_equals_train(target, head) -> None:
    """The body of the test above, for a head built any way."""
    from models.heads.trees import TreeSpec, path_to

    spec = TreeSpec(budget=10, depth=min(4, head.num_steps), topk=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (9,), generator=g)
    head.start(ids, target(ids[None]))
    for round_ in range(4):
        pending = int(torch.randint(0, 128, (), generator=g))
        at = ids.numel() - 1
        sampled = copy.deepcopy(head).propose_tree(pending, spec, Sampler(1.0, generator=torch.Generator().manual_seed(round_)))
        tree = head.propose_tree(pending, spec, Sampler())
        for prop, greedy in ((tree, True), (sampled, False)):
            par = prop.parents.tolist()
            assert 1 <= len(par) <= spec.budget and all(p < i for i, p in enumerate(par))
            assert int(max(len(path_to(i, prop.parents)) for i in range(len(par)))) <= spec.depth
            for parent in sorted(set(par)):
                kids = [i for i, p in enumerate(par) if p == parent]
                path = path_to(parent, prop.parents) if parent >= 0 else []
                seq = torch.cat([ids, torch.tensor([pending]), prop.tokens[path]])
                tf = head.teacher_forced_logits(seq[None], target(seq[None]), at, len(path) + 1)[-1]  # [V]
                if greedy:
                    top = tf.topk(len(kids)).indices.tolist()
                    assert prop.tokens[kids].tolist() == top, f"round {round_}, parent {parent}"
                else:
                    torch.testing.assert_close(prop.probs[kids[0]].float(), torch.softmax(tf, -1), atol=2e-5, rtol=1e-4)
                    assert len(set(prop.tokens[kids].tolist())) == len(kids)  # drawn without replacement
        # accept the path to some node (round 0: none), then check a chain proposal still equals training
        node = [-1, 0, len(tree.parents) - 1, int(tree.parents[-1])][round_]
        path = path_to(node, tree.parents) if node >= 0 else []
        block = torch.cat([torch.tensor([pending]), tree.tokens[path]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))
        pending = int(torch.randint(0, 128, (), generator=g))
        drafts = copy.deepcopy(head).propose(pending, 2, Sampler()).tokens
        seq = torch.cat([ids, torch.tensor([pending]), drafts])
        tf = head.teacher_forced_logits(seq[None], target(seq[None]), ids.numel() - 1, drafts.numel())
        assert tf.argmax(-1).tolist() == drafts.tolist()
