"""Tree drafting by the heads whose slots need no tree attention (Medusa, DFlash, DSpark) is lossless: with a tiny
random target, tree decoding equals plain greedy at T=0 and produces every token at T=1."""
from __future__ import annotations

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_model
from eval.decoder import Sampler, SpeculativeDecoder
from models.heads.trees import TreeSpec
from models.target import FrozenTarget, default_tap_layers
from test_decoder import PROMPTS, plain_greedy

FAMILIES = ["medusa", "dflash", "dspark"]


def _head(family):
    cfg = OmegaConf.load(ROOT / "conf" / "draft" / f"{family}.yaml")
    cls = hydra.utils.get_class(cfg._target_)
    model = tiny_model("llama", layers=6)
    target = FrozenTarget(model=model, tap_layers=default_tap_layers(6, cls.tap_method, 3))
    torch.manual_seed(0)
    head = hydra.utils.instantiate(cfg, target=target, _convert_="all")
    with torch.no_grad():  # random zero-initialised parts too (Medusa's blocks, DSpark's Markov term)
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model, target, head


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_decoding_is_lossless(family, temperature):
    model, target, head = _head(family)
    tree = TreeSpec(budget=8, depth=3, topk=2)
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    if temperature == 0:
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, tree=tree)
        assert out == plain_greedy(model, PROMPTS[1], 18)
    else:
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))
        out, st = dec.generate(PROMPTS[1], head, max_new_tokens=18, tree=tree, sampler=sampler)
        assert len(out) == 18 and all(0 <= t < target.config.vocab_size for t in out)
        assert sum(st.accepted_hist) > 0  # the tiny target is flat at T=1: accepted paths (and commits) happen
    assert st.passes >= 1 and st.drafted > 0 and all(0 <= a <= tree.depth for a in st.accepted_hist)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_shape_follows_the_spec(family):
    """At most ``budget`` nodes, parents before children, no deeper than the spec or the head's slots."""
    from models.heads.trees import node_depths

    _, target, head = _head(family)
    head.start(PROMPTS[1][None], target(PROMPTS[1][None]))
    for spec in (TreeSpec(budget=8, depth=3, topk=2), TreeSpec(budget=40, depth=20, topk=3)):
        for sampler in (Sampler(), Sampler(1.0, generator=torch.Generator().manual_seed(2))):
            prop = head.propose_tree(5, spec, sampler)
            par = prop.parents.tolist()
            assert 1 <= len(par) <= spec.budget and all(p < i for i, p in enumerate(par))
            assert int(node_depths(prop.parents).max()) <= min(spec.depth, head.num_steps)
            assert (prop.probs is None) == sampler.greedy
