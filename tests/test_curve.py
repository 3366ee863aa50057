"""`python -m eval.curve` end to end on a tiny target: one family at two budgets in one resumed run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, train_overrides
from data.errors import UserError
from eval.curve import budget_overrides, budget_steps, correlation_t1, correlations, pearson


def test_budgets_and_correlation():
    assert budget_steps([2, 4], "steps", None) == [2, 4]
    assert budget_steps([1e4, 3e4], "tokens", 1000) == [10, 30]
    with pytest.raises(UserError, match="increasing"):
        budget_steps([4, 2], "steps", None)
    with pytest.raises(UserError, match="tokens_per_step"):
        budget_steps([100], "tokens", None)
    assert budget_steps([900, 3600], "seconds", None) == [900, 3600]
    assert budget_overrides("seconds", "fixed", 900, 3600) == ["time_budget_s=3600", "stop_at_s=900", "trainer.max_steps=10000000"]
    assert budget_overrides("seconds", "raise", 900, 3600) == ["time_budget_s=900", "trainer.max_steps=10000000"]
    assert budget_overrides("steps", "fixed", 50, 200) == ["trainer.max_steps=200", "stop_at_step=50"]
    with pytest.raises(UserError, match="unit='hours'"):
        budget_steps([1], "hours", None)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and pearson([1, 2], [1, 2]) is None
    pts = [{"val_acc_len": a, "tau_mean": {"T=0": t}} for a, t in ((1.1, 1.2), (1.2, 1.5), (1.4, 1.6))]
    assert correlations(pts)["T=0"]["n"] == 3 and correlations(pts)["all"]["pearson"] > 0.8
    pts = [{"val_acc_len_t1": a, "tau_mean": {"T=0": 2.0, "T=1": t}} for a, t in ((1.3, 1.4), (1.5, 1.3), (1.6, 1.2))]
    assert correlation_t1(pts)["n"] == 3 and correlation_t1(pts)["pearson"] < -0.8  # T=1's metric against T=1's τ
    assert correlation_t1([{"val_acc_len_t1": None, "tau_mean": {"T=1": 1.0}}])["n"] == 0


def test_curve_resumes_one_run_and_writes_json_and_plot(tiny_target_dir, tiny_chats, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello! How can I help you today?"}\n{"prompt": "Write a poem about the sea."}\n')
    shared = [o for o in train_overrides(tiny_target_dir, tiny_chats, tmp_path / "unused", steps=2)
              if not o.startswith(("run_dir=", "draft.ttt_steps=", "trainer.max_steps="))]
    out = tmp_path / "curve"
    args = [sys.executable, "-m", "eval.curve", f"run_dir={out}", f"target.name_or_path={tiny_target_dir}",
            "train_overrides=[" + ",".join(f"'{o}'" for o in shared) + "]", "budgets=[2,4]",
            "families.eagle3=['draft=eagle3','draft.ttt_steps=2']", "eval_set=[jsonl]", f"eval_set.jsonl.path={prompts}",
            "eval_set.jsonl.follow_turns=false", "max_new_tokens=8", "k=3", "limit=2", "temperatures=[0.0]"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    curve = json.loads((out / "curve.json").read_text())
    assert (out / "curve.png").stat().st_size > 0
    assert set(curve["references"]) == {"plain", "ngram"} and curve["references"]["plain"]["T=0"] == 1.0
    p1, p2 = curve["points"]
    for p, steps in ((p1, 2), (p2, 4)):
        assert p["family"] == "eagle3" and p["steps"] == steps and p["train_tokens"] > 0
        assert p["val_acc_len"] >= 1.0 and len(p["val_acc"]) == 2 and p["tau_mean"]["T=0"] >= 1.0
        assert set(p["tau"]["T=0"]) == {"prompts"} and p["acceptance_per_position"]
        assert p["greedy"]["prompts T=0"]["greedy_identical"] == "2/2" and p["speedup_mean"]["T=0"] > 0
    # the second point continued the first run: it started at step 2, and its token count adds to the first's
    assert p1["resumed_from_step"] == 0 and p2["resumed_from_step"] == 2
    assert p2["train_tokens"] > p1["train_tokens"]
    assert r.stdout.count("resuming from step 2") == 1 or "resuming from step 2" in r.stderr
    assert set(curve["correlation"]) == {"T=0", "all"} and curve["correlation"]["all"]["n"] == 2
    assert p1["val_acc_len_t1"] > 1.0 and curve["correlation_t1"]["n"] == 0  # eagle3 reports it; no T=1 points here
    # a rerun finds both points done: nothing is trained again
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "== eagle3: step" not in r.stdout, r.stdout[-2000:]
