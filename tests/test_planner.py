"""The plan before launch (python -m eval.planner plan=true): parameter counts of real 8B configs from their config.json
alone, bytes per device replicated vs sharded, the feature cache's bytes per token, hours from a measured throughput."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests/fixtures/configs"
PY = sys.executable


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("planner", overrides=["plan=true", "out_dir=unused", *overrides])


def plan_of(*overrides: str) -> dict:
    from train.plan import build_plan

    return build_plan(compose(*overrides))


# published totals: Llama-3.1-8B 8.03 B, Qwen3-8B 8.19 B parameters (their model cards)
@pytest.mark.parametrize("folder,total", [("llama-3.1-8b-instruct", 8.03e9), ("qwen3-8b", 8.19e9)])
def test_parameter_counts_of_real_configs(folder, total):
    p = plan_of(f"target.name_or_path={CONFIGS / folder}", "target.dtype=auto")
    n = p["parameters"]
    assert abs(n["target"] - total) / total < 0.01
    assert p["target_dtype"] == "bfloat16"
    # the head is built with this target: EAGLE-3's fc reads 3 taps of width d, its lm_head the draft vocabulary
    d = json.loads((CONFIGS / folder / "config.json").read_text())["hidden_size"]
    assert n["draft_trainable"] > 3 * d * d + 32000 * d
    assert n["draft_total"] > n["draft_trainable"]  # the frozen embedding copy


def test_fsdp_shards_what_ddp_replicates():
    base = [f"target.name_or_path={CONFIGS / 'qwen3-8b'}", "target.dtype=bfloat16", "devices=8"]
    ddp, fsdp = plan_of(*base, "trainer=ddp"), plan_of(*base, "trainer=fsdp")
    assert ddp["strategy"] == "ddp" and fsdp["strategy"] == "fsdp"
    r, f = ddp["bytes_per_device"], fsdp["bytes_per_device"]
    n = ddp["parameters"]
    assert r["target_weights"] == n["target"] * 2  # frozen, bf16
    assert r["optimizer"] == n["draft_trainable"] * 8 and r["gradients"] == n["draft_trainable"] * 4
    for k in ("target_weights", "draft_weights", "gradients", "optimizer"):
        assert f[k] == -(-r[k] // 8)
    assert f["activations"] == r["activations"] > 0  # per device either way
    assert 0 < f["fsdp_gather_peak"] < r["target_weights"] / 8
    assert f["total"] < r["total"]
    one = plan_of(*base[:2], "devices=1", "trainer=fsdp")["bytes_per_device"]
    assert one["target_weights"] == r["target_weights"]  # one device: nothing to shard over


def test_activations_scale_with_batch_and_length():
    base = [f"target.name_or_path={CONFIGS / 'llama-3.1-8b-instruct'}"]
    a = plan_of(*base, "batch_size=2", "seq_len=256")["bytes_per_device"]["activations"]
    b = plan_of(*base, "batch_size=4", "seq_len=256")["bytes_per_device"]["activations"]
    c = plan_of(*base, "batch_size=2", "seq_len=512")["bytes_per_device"]["activations"]
    assert b == 2 * a and c == 2 * a


def test_cache_bytes_and_hours_from_throughput(tmp_path):
    bench = tmp_path / "bench_train.json"
    bench.write_text(json.dumps({"device": "test", "precisions": {"bf16-mixed": {
        "online_tokens_per_s": 1000.0, "offline_tokens_per_s": 4000.0, "target_forward_tokens_per_s": 2000.0}}}))
    p = plan_of(f"target.name_or_path={CONFIGS / 'qwen3-8b'}", "tokens=7200000", "devices=2", "trainer=ddp",
                f"throughput={bench}")
    c = p["cache"]
    d = 4096
    assert c["bytes_per_token"]["total"] == 3 * d * 2 + d * 2 + 5  # EAGLE-3: 3 taps + last state in bf16, id + mask
    assert c["total_bytes"] == c["bytes_per_token"]["total"] * 7_200_000
    t = p["time"]
    assert t["train_online_epoch_h"] == pytest.approx(7.2e6 / 2000 / 3600, rel=1e-3)
    assert t["feature_cache_h"] == pytest.approx(7.2e6 / 4000 / 3600, rel=1e-3)
    assert t["regeneration_h"] == "not measured"
    none = plan_of(f"target.name_or_path={CONFIGS / 'qwen3-8b'}", "tokens=100")
    assert none["throughput"] == "not measured" and none["time"]["train_online_epoch_h"] == "not measured"


def test_command_prints_table_and_writes_plan(tmp_path):
    out = subprocess.run([PY, "-m", "eval.planner", "plan=true", "target=hf",
                          f"target.name_or_path={CONFIGS / 'llama-3.1-8b-instruct'}", "trainer=fsdp", "devices=4",
                          f"out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GiB per device" in out.stdout and "fsdp/4" in out.stdout and "estimate" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["devices"] == 4 and plan["strategy"] == "fsdp"


@pytest.mark.parametrize("override,names", [("throughput=/nonexistent/bench.json", "throughput="), ("devices=0", "devices="),
                                            ("seq_len=0", "seq_len="), ("target.name_or_path=/nonexistent/model", "/nonexistent")])
def test_bad_input_names_the_field(override, names):
    from data.errors import UserError

    with pytest.raises(UserError, match=names):
        plan_of(f"target.name_or_path={CONFIGS / 'qwen3-8b'}", override)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text('{"precisions": {}}')
    out = subprocess.run([PY, "-m", "eval.planner", "plan=true", f"target.name_or_path={CONFIGS / 'qwen3-8b'}",
                          f"out_dir={tmp_path}", f"throughput={bad}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: throughput=")
    assert not (tmp_path / "plan.json").exists()
