"""Draft trees of the autoregressive heads (EAGLE-3, MTP): lossless through the decoder, a topk=1 tree is the chain,
and deep trees (several parents per level) equal the teacher-forced training forward on every path."""
from __future__ import annotations

import copy

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_model
from eval.decoder import Sampler, SpeculativeDecoder
from models.heads.trees import TreeSpec, chain_parents, node_depths, path_to
from models.target import FrozenTarget, default_tap_layers
from test_decode_equals_train import _perturbed, _tail
from test_decoder import PROMPTS, plain_greedy

AR = [ROOT / "conf" / "draft" / f"{n}.yaml" for n in ("eagle3", "mtp", "mtp_speculators")]


@pytest.mark.parametrize("cfg_path", AR, ids=lambda p: p.stem)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_decodes_losslessly(cfg_path, temperature):
    cfg = OmegaConf.load(cfg_path)
    cls = hydra.utils.get_class(cfg._target_)
    model = tiny_model("llama", layers=6)
    target = FrozenTarget(model=model, tap_layers=default_tap_layers(6, cls.tap_method, 3))
    torch.manual_seed(0)
    head = hydra.utils.instantiate(cfg, target=target, _convert_="all")
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    spec = TreeSpec(budget=8, depth=3, topk=2)
    if temperature == 0:
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, tree=spec)
        assert out == plain_greedy(model, PROMPTS[1], 18)
    else:
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, sampler=sampler, tree=spec)
        assert len(out) == 18
    assert st.passes >= 1 and st.drafted > st.passes  # trees, not single tokens


@pytest.mark.parametrize("cfg_path", AR, ids=lambda p: p.stem)
def test_topk1_tree_is_the_chain(cfg_path):
    target, head = _perturbed(cfg_path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (7,), generator=g)
    head.start(ids, target(ids[None]))
    for n_acc in (0, 2, 1, 3):
        pending, k = int(torch.randint(0, 128, (), generator=g)), head.num_steps
        chain = copy.deepcopy(head).propose(pending, k, Sampler())
        tree = head.propose_tree(pending, TreeSpec(budget=k, depth=k, topk=1), Sampler())
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert torch.equal(tree.parents, chain_parents(k))
        block = torch.cat([torch.tensor([pending]), tree.tokens[:n_acc]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))


@pytest.mark.parametrize("prompt_len", [1, 9])
@pytest.mark.parametrize("cfg_path", AR, ids=lambda p: p.stem)
def test_deep_tree_nodes_equal_the_training_forward(cfg_path, prompt_len):
    """Every level expanded, several parents per level (the decode-equals-train test stops at its budget after two
    levels): each node's children are the training forward's top tokens on the node's path."""
    target, head = _perturbed(cfg_path)
    spec = TreeSpec(budget=14, depth=min(4, head.num_steps), topk=2)
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, 128, (prompt_len,), generator=g)
    head.start(ids, target(ids[None]))
    for round_ in range(3):
        pending = int(torch.randint(0, 128, (), generator=g))
        tree = head.propose_tree(pending, spec, Sampler())
        par = tree.parents
        assert int(node_depths(par).max()) == spec.depth
        assert len({int(par[i]) for i in range(len(par)) if node_depths(par)[i] == spec.depth}) == 2
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
