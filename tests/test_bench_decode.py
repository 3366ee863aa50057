"""`python -m eval.bench_decode` on a tiny random target: every field of bench_decode.json, and its bad inputs."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from data.errors import UserError


def compose_bench(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("bench_decode", overrides=overrides)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    p.write_text('{"prompt": "Write a poem about the sea. The sea is wide and deep and blue."}\n')
    return p


def base(target_dir, prompts, out) -> list[str]:
    return [f"target.name_or_path={target_dir}", "eval_set=[jsonl]", f"eval_set.jsonl.path={prompts}", f"out_dir={out}",
            "limit=1", "max_new_tokens=12", "k=3", "profile.context=32", "profile.top=5", "profile.repeat=2", "isolated_reps=1"]


def test_bench_decode_writes_every_field(tiny_target_dir, prompts, tmp_path):
    from eval.bench_decode import bench

    # a random-weight Medusa head drafts trees (propose_tree); n-gram drafts chains of k
    medusa = "+drafters.medusa={_target_:models.heads.medusa.MedusaHead,num_heads:2}"
    cfg = compose_bench(base(tiny_target_dir, prompts, tmp_path) + [
        medusa, "drafters.head.path=null", "temperatures=[0.0,1.0]", "tree={budget:4,depth:2,topk:2}"])
    res = bench(cfg)
    assert json.loads((tmp_path / "bench_decode.json").read_text()) == res
    p = res["protocol"]
    assert p["fast_linear"] is True and p["k"] == 3 and p["tree"]["budget"] == 4 and p["prompts"] == 1
    assert set(p["drafters"]) == {"ngram", "medusa"}  # head: path null, skipped
    assert set(res["results"]) == {"T=0", "T=1"}
    for tname, row in res["results"].items():
        assert row["t1_ms"] > 0 and set(row) == {"t1_ms", "plain", "ngram", "medusa"}
        assert row["plain"]["tau"] == 1.0 and row["plain"]["mean_block"] == 1.0 and row["plain"]["drafted"] == 0
        assert row["plain"]["speedup"] == 1.0 and row["plain"]["verify_cost_ratio"] == 1.0
        for name in ("ngram", "medusa"):
            m = row[name]
            assert m["tau"] >= 1.0 and m["mean_block"] >= 1.0 and m["passes"] >= 1 and m["new_tokens"] >= 1
            assert m["tokens_per_s"] > 0 and m["speedup"] > 0 and m["verify_cost_ratio"] > 0
            assert 0 <= m["decoder_share"] <= 1 and all(0 <= v <= 1 for v in m["time_share"].values())
            assert m["free_draft_bound"] == pytest.approx(m["tau"] / m["verify_cost_ratio"], rel=0.02)
            assert m["realised_over_bound"] > 0 and m["isolated_verify_cost_ratio"] > 0
            assert m["draft_cost_per_token"] is None or m["draft_cost_per_token"] > 0
        assert row["medusa"]["tree"] is True and row["ngram"]["tree"] is False
        med = row["medusa"]
        assert med["drafted"] > 0 and med["draft_cost_per_token"] > 0
        r, d = med["verify_cost_ratio"], med["drafted"] / med["passes"]
        assert med["bound_left_by_draft"] == pytest.approx(r / (r + d * med["draft_cost_per_token"]), rel=0.02)
        assert med["draft_cost_for_80pct"] == pytest.approx(r / (4 * d), rel=0.02)
        assert med["realised_over_bound"] <= med["bound_left_by_draft"] * 1.1  # the decoder and prefill only take more
        if tname == "T=0":
            assert row["ngram"]["greedy_identical"] == "1/1" and row["medusa"]["greedy_identical"] == "1/1"
    assert res["isolated"]["ratio"][0] == 1.0 and len(res["isolated"]["t_ms"]) >= 1
    target_prof = res["profiles"]["target"]
    assert "1" in target_prof and all(e["context"] == 32 for e in target_prof.values())
    for e in [*target_prof.values(), *res["profiles"]["propose"].values()]:
        assert 1 <= len(e["ops"]) <= 5 and e["self_cpu_ms"] > 0 and e["repeat"] == 2
        assert all(o["name"] and o["calls"] > 0 and o["self_ms_per_call"] >= 0 for o in e["ops"])
    assert res["profiles"]["propose"]["medusa"]["call"] == "propose_tree"
    assert all(e["after_round"] == 3 for e in res["profiles"]["propose"].values())  # conf/bench_decode.yaml's default
    assert res["profiles"]["propose"]["ngram"]["call"] == "propose"


@pytest.mark.parametrize("extra,expect", [
    (["drafters.head.path=/nonexistent/head"], "no such directory"),
    (["tree={budget:0,depth:2,topk:2}"], "budget=0"),
    (["tree={budget:4,depth:2,width:2}"], "unknown key"),
    (["tree={budget:x}"], "integers"),
    (["k=0"], "k=0"),
    (["profile.after_round=-1"], "after_round=-1"),
])
def test_bench_decode_bad_input(tiny_target_dir, prompts, tmp_path, extra, expect):
    from eval.bench_decode import bench

    with pytest.raises(UserError, match=expect):
        bench(compose_bench(base(tiny_target_dir, prompts, tmp_path) + extra))


@pytest.mark.parametrize("tree", [None, {"budget": 4, "depth": 3, "topk": 2}])
def test_the_profiled_propose_is_a_decoding_rounds(tiny_target_dir, tree):
    """``profile.after_round=m``: the profiled call drafts what a head started on the prompt less its last token
    drafts with that token pending (the round before it left a real decoding state), for MTP, whose depths catch
    up on the prompt in their first ``propose``."""
    import torch

    from eval.bench_decode import profile_propose, tree_spec
    from eval.decoding.decoder import Sampler
    from eval.decoding.kvcache import new_cache
    from models.heads.mtp import MTPHead
    from models.target import FrozenTarget

    torch.manual_seed(0)
    target = FrozenTarget(str(tiny_target_dir))
    head = MTPHead(target, num_modules=3).eval()
    for p in head.parameters():  # random weights of a visible scale, so the drafts depend on the state
        torch.nn.init.normal_(p, std=0.3)
    spec = tree_spec(tree)
    ids = torch.randint(0, target.vocab_size, (1, 20))
    drafts = []
    real = head.propose_tree if spec else head.propose

    def spy(*args):  # records (tokens the head holds, the proposal): the rounds in reset() hold fewer
        drafts.append((head._ids.numel(), real(*args)))
        return drafts[-1][1]

    setattr(head, "propose_tree" if spec else "propose", spy)
    res = profile_propose(target, head, ids, 3, spec, top=3, repeat=1, after_round=3)
    assert res["after_round"] == 3 and res["call"] == ("propose_tree" if spec else "propose")
    profiled = [p for n, p in drafts if n == ids.shape[1] - 1]
    assert len(profiled) == 2  # the warm-up call and the profiled one
    out = target(ids[:, :-1], cache=new_cache(), use_cache=True)
    head.start(ids[:, :-1], out)
    fresh = real(int(ids[0, -1]), spec or 3, Sampler())
    assert all(torch.equal(fresh.tokens, p.tokens) for p in profiled)
    assert len(fresh.tokens) == (4 if spec else 3)
