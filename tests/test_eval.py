"""`python -m eval` end to end on a tiny target, and its bad inputs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, train_overrides


@pytest.fixture(scope="module")
def trained(tiny_target_dir, tiny_chats, tmp_path_factory):
    """A tiny EAGLE-3 draft trained for a few steps (exported)."""
    from hydra import compose, initialize_config_dir

    from train.__main__ import run

    run_dir = tmp_path_factory.mktemp("run")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=train_overrides(tiny_target_dir, tiny_chats, run_dir, steps=2))
    run(cfg)
    return run_dir / "draft"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    p.write_text('{"prompt": "Hello! How can I help you today?"}\n'
                 '{"id": "two", "messages": [{"role": "user", "content": "Write a poem about the sea."}, '
                 '{"role": "assistant", "content": "ignored"}, {"role": "user", "content": "Thanks a lot!"}]}\n')
    return p


def run_eval(*args, draft_model: str | None = None):
    """`python -m eval`; the shipped draft model only fits the embedded target, so it is left out unless given."""
    dm = f"drafters.draft_model.path={draft_model}" if draft_model else "drafters.draft_model=null"
    return subprocess.run([sys.executable, "-m", "eval", dm, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_eval_writes_table_json_and_plot(tiny_target_dir, trained, prompts, tmp_path):
    out = tmp_path / "eval"
    r = run_eval(f"target.name_or_path={tiny_target_dir}", f"drafters.eagle3.path={trained}", "eval_set=[jsonl]",
                 f"eval_set.jsonl.path={prompts}", f"out_dir={out}", "max_new_tokens=12", "k=3", "device=cpu",
                 f"+drafters.tree_auto={{_target_: eval.decoding.drafters.load_head, path: {trained}, tree: {{budget: 4, depth: 3, topk: 2}}, k: auto}}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "max_new_tokens=12" in r.stdout and "| set | T | drafter |" in r.stdout
    res = json.loads((out / "results.json").read_text())
    row = res["results"]["prompts"]
    assert set(row) == {"T=0", "T=1"} and set(row["T=0"]) == {"plain", "ngram", "eagle3", "tree_auto"}
    for t in ("T=0", "T=1"):  # k=auto over a tree of depth <= 3: k is the depth chosen each round
        assert set(row[t]["tree_auto"]["auto_k"]["histogram"]) <= {"1", "2", "3"}
    assert row["T=0"]["tree_auto"]["greedy_identical"] == "3/3"
    # 3 generations (one prompt + a two-turn chat), every drafter identical to plain at T=0
    assert row["T=0"]["eagle3"]["greedy_identical"] == "3/3" and row["T=0"]["ngram"]["greedy_identical"] == "3/3"
    assert row["T=0"]["plain"]["tau"] == 1.0 and row["T=0"]["eagle3"]["tau"] >= 1.0
    assert (out / "acceptance.png").stat().st_size > 1000 and (out / "results.md").exists()


@pytest.mark.parametrize("extra,expect", [
    (["eval_set=[jsonl]", "eval_set.jsonl.path=/nonexistent.jsonl"], "no such prompt file"),
    (["temperatures=[-1]"], "temperature"),
    (["k=0"], "k=0"),
    pytest.param(["device=cuda"], "device='cuda' but no GPU is visible; use device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
    (["device=tpu:x"], "device='tpu:x': use auto, cpu, cuda or cuda:N"),
])
def test_eval_bad_input(tiny_target_dir, trained, prompts, extra, expect, tmp_path):
    base = [f"target.name_or_path={tiny_target_dir}", f"drafters.eagle3.path={trained}", "eval_set=[jsonl]",
            f"eval_set.jsonl.path={prompts}", f"out_dir={tmp_path}"]
    r = run_eval(*base, *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    errs = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errs) == 1 and expect in errs[0], r.stderr[-1000:]


def test_malformed_prompt_file_and_foreign_draft(tiny_target_dir, trained, tmp_path):
    from conftest import write_tiny_target

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    r = run_eval(f"target.name_or_path={tiny_target_dir}", f"drafters.eagle3.path={trained}", "eval_set=[jsonl]",
                 f"eval_set.jsonl.path={bad}", f"out_dir={tmp_path}/o")
    assert r.returncode == 2 and f"{bad}:2: malformed JSON" in r.stderr
    other = write_tiny_target(tmp_path / "other", layers=6)
    r = run_eval(f"target.name_or_path={other}", f"drafters.eagle3.path={trained}", "eval_set=[jsonl]",
                 f"eval_set.jsonl.path={bad}", f"out_dir={tmp_path}/o")
    assert r.returncode == 2 and "draft was built for target" in r.stderr
    r = run_eval(f"target.name_or_path={tiny_target_dir}", f"drafters.eagle3.path={trained}", "eval_set=[jsonl]",
                 f"eval_set.jsonl.path={bad}", f"out_dir={tmp_path}/o", draft_model=str(ROOT / "assets/draft_model"))
    assert r.returncode == 2 and "vocabulary 8192 != target's" in r.stderr.splitlines()[-1], r.stderr[-800:]


def test_interrupted_eval_resumes_without_redoing_prompts(tiny_target_dir, prompts, tmp_path):
    """A finished run's journal cut back to one prompt (and a line cut off mid-write) resumes with resume=true: the
    missing prompts are decoded, the kept one is read back, and the figures equal an uninterrupted run's."""
    out = tmp_path / "eval"
    base = [f"target.name_or_path={tiny_target_dir}", "drafters.eagle3=null", "eval_set=[jsonl]",
            f"eval_set.jsonl.path={prompts}", f"out_dir={out}", "max_new_tokens=10", "k=3"]
    r = run_eval(*base)
    assert r.returncode == 0, r.stderr[-3000:]
    full = json.loads((out / "results.json").read_text())["results"]
    assert "eval: 4/4 prompts" in r.stderr  # progress on a pipe: plain lines
    metrics = list((out / "logs").rglob("metrics.csv"))  # the configured logger (csv) got the figures
    assert metrics and "prompts/T=0/ngram/tau" in metrics[0].read_text()

    journal = out / "journal.jsonl"
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 4  # header + 2 prompts x 2 temperatures
    journal.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # killed while writing
    r2 = run_eval(*base)
    assert r2.returncode == 2 and "resume=true" in r2.stderr  # never silently over an earlier evaluation
    r3 = run_eval(*base, "resume=true")
    assert r3.returncode == 0, r3.stderr[-3000:]
    assert "resume: 1 of 4 prompts already evaluated" in r3.stdout + r3.stderr
    again = json.loads((out / "results.json").read_text())["results"]
    for t in ("T=0", "T=1"):
        for d in ("plain", "ngram"):
            a, b = full["prompts"][t][d], again["prompts"][t][d]
            assert (a["tau"], a["new_tokens"], a["verify_passes"]) == (b["tau"], b["new_tokens"], b["verify_passes"])
    assert again["prompts"]["T=0"]["ngram"]["greedy_identical"] == "3/3"
    r4 = run_eval(*base[:-1], "k=2", "resume=true")  # another protocol: refused in one line
    assert r4.returncode == 2 and "k differ" in r4.stderr, r4.stderr[-1000:]


def test_progress_lines_on_a_pipe():
    import io

    from data.progress import Progress

    buf = io.StringIO()
    p = Progress(3, "eval", unit="prompts", every_s=0.0, file=buf)
    for _ in range(3):
        p.update(1, note="x")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("eval: 1/3 prompts (33%)") and "left" in lines[0]
    assert lines[-1].startswith("eval: 3/3 prompts (100%)") and "left" not in lines[-1]
