"""Model cards (train/card.py): what a card says comes from the folder, its run and the evaluation; export and ship
write one; families no engine serves say so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, write_tiny_target
from test_formats import make_head

from data.errors import UserError
from models.heads.base import FORMAT
from train.card import SETS, card_text, folder_facts, run_facts, write_card


def evaluation(heads: list[str], seed: float = 0.0) -> dict:
    """A results.json of `python -m eval` with plain decoding and ``heads`` on two sets at T=0 and T=1."""
    results = {}
    for i, s in enumerate(("mtbench", "humaneval")):
        results[s] = {}
        for t in (0, 1):
            per_t = {"plain": {"tau": 1.0, "speedup": 1.0, "acceptance_per_position": []}}
            for j, h in enumerate(heads):
                per_t[h] = {"tau": 1.5 + seed + 0.25 * i + 0.125 * t + j, "speedup": 1.1 + 0.05 * i + j,
                            "acceptance_per_position": [0.7 - 0.1 * t, 0.5]}
            results[s][f"T={t}"] = per_t
    return {"protocol": {"limit": 3, "max_new_tokens": 16, "k": "auto", "dtype": "float32"}, "results": results}


def fake_folder(path: Path, family: str, report: dict | None = None) -> Path:
    """A draft folder holding only what a card reads: our config.json (and a report.json)."""
    path.mkdir(parents=True)
    cfg = {"format": FORMAT, "family": family, "class": f"models.heads.{family}.X", "init_args": {"ttt_steps": 2},
           "target": {"name_or_path": "some/target"}, "tap_layers": [1, 2, 3], "num_steps": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    if report is not None:
        (path / "report.json").write_text(json.dumps(report))
    return path


REPORT = {"training": {"global_step": 12, "train_tokens": 3456, "train_time_s": 7.0, "val/acc_0": 0.625, "val/acc_1": 0.375,
                       "val/acc_len": 2.0}, "data_source": "chats.jsonl"}


def test_card_says_what_the_report_and_evaluation_hold(tmp_path):
    ev = evaluation(["head"], seed=0.3)
    folder = fake_folder(tmp_path / "e3", "eagle3", {**REPORT, "evaluation": ev})
    text = (write_card(folder, measured="2026-01-01, a test machine: python -m eval")).read_text()
    assert "some/target" in text and "chats.jsonl" in text and "3,456" in text and "Measured 2026-01-01" in text
    t = REPORT["training"]
    assert f"{t['val/acc_len']:.3f}" in text and f"{t['val/acc_0']:.3f} / {t['val/acc_1']:.3f}" in text
    for s, per_set in ev["results"].items():
        for temp, per_t in per_set.items():
            r = per_t["head"]
            assert f"| {SETS[s]} | {temp[2:]} | {r['tau']:.2f} | {r['speedup']:.2f}× |" in text
    # EAGLE-3 is served by both engines: export lines, then vLLM's and SGLang's
    assert "format=speculators" in text and "vllm serve some/target --speculative-config" in text
    assert '"method": "eagle3"' in text and "--speculative-algorithm EAGLE3" in text and "format=sglang" in text
    assert "not servable" not in text


def test_families_no_engine_serves_say_so(tmp_path):
    text = card_text(tmp_path / "m", {"family": "medusa", "target": {"name_or_path": "t"}, "format": "draftsmith",
                                      "reads": "the final-norm state", "init_args": {}}, REPORT)
    assert "not servable by vLLM/SGLang" in text and "vllm serve" not in text and "sglang" not in text
    dflash = card_text(tmp_path / "d", {"family": "dflash", "target": {"name_or_path": "t"}, "format": "draftsmith",
                                        "reads": "tap layers [1]", "init_args": {}}, REPORT)
    assert "--speculative-algorithm DFLASH" in dflash and "vllm serve" in dflash and "EAGLE3" not in dflash


def test_an_evaluation_of_several_heads_needs_the_drafter_named(tmp_path):
    ev = evaluation(["a", "b"])
    folder = fake_folder(tmp_path / "f", "eagle3", {**REPORT, "evaluation": ev})
    assert "drafter=<name>" in write_card(folder).read_text()  # the report's own evaluation: the card still gets written
    with pytest.raises(UserError, match="name the one"):
        write_card(folder, evaluation=ev)
    with pytest.raises(UserError, match="drafter=c: not in the evaluation"):
        write_card(folder, drafter="c")
    text = write_card(folder, drafter="b").read_text()
    assert f"| MT-Bench | 0 | {ev['results']['mtbench']['T=0']['b']['tau']:.2f} |" in text


@pytest.mark.slow
def test_export_and_ship_write_a_card(tmp_path):
    target_dir = write_tiny_target(tmp_path / "target", layers=6)
    _, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "run" / "draft", train_config={"name": "tiny", "data": {"source": "tiny-chats.jsonl"}})
    (tmp_path / "run" / "result.json").write_text(json.dumps(REPORT["training"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for cmd in ([sys.executable, "-m", "train.export", f"src={tmp_path / 'run'}", "format=speculators"],
                [sys.executable, "-m", "train.ship", f"src={tmp_path / 'run'}", f"out={tmp_path / 'shipped'}"]):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    spec = (tmp_path / "run-speculators" / "README.md").read_text()
    assert "speculators format" in spec and f"vllm serve {tmp_path / 'run-speculators'}" in spec
    assert "tiny-chats.jsonl" in spec and f"{REPORT['training']['val/acc_len']:.3f}" in spec
    shipped = (tmp_path / "shipped" / "README.md").read_text()
    assert "our own format" in shipped and "tiny-chats.jsonl" in shipped
    # the card names the folder it was shipped as, never the temporary one it was written in
    assert shipped.startswith("# shipped: ") and f"path: {tmp_path / 'shipped'}}}" in shipped and ".tmp" not in shipped
    assert folder_facts(tmp_path / "shipped")["family"] == run_facts(tmp_path / "shipped")["family"] == "eagle3"
    # a second export over the first (its card included) is still an export of ours
    again = subprocess.run([sys.executable, "-m", "train.export", f"src={tmp_path / 'run'}", "format=speculators"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


def test_the_answer_temperature_reaches_the_card_and_eval_notes_another(tmp_path):
    """A head trained on greedy answers: its card says it is for T=0, and ``python -m eval`` at T=0 and T=1 notes T=1
    only; a head trained on a named dataset's own answers gets no note."""
    from eval.decoding.drafters import load_head, temperature_notes

    target_dir = write_tiny_target(tmp_path / "target", layers=6)
    target, head = make_head("dflash", target_dir)
    greedy = {"data": {"source": "runs/x/train.jsonl", "make": {"temperature": 0, "file": "runs/x/train.jsonl"}}}
    head.export(tmp_path / "greedy", train_config=greedy)
    head.export(tmp_path / "sharegpt", train_config={"data": {"source": "sharegpt"}})
    text = card_text(tmp_path / "greedy", folder_facts(tmp_path / "greedy"), run_facts(tmp_path / "greedy"))
    assert "greedy (T=0); the head is for decoding at T=0" in text
    assert "sampled at" not in card_text(tmp_path / "sharegpt", folder_facts(tmp_path / "sharegpt"),
                                         run_facts(tmp_path / "sharegpt"))
    heads = {"g": load_head(str(tmp_path / "greedy"), target), "s": load_head(str(tmp_path / "sharegpt"), target)}
    assert heads["g"].answer_temperature == 0.0 and heads["s"].answer_temperature is None
    assert temperature_notes(heads, [0.0, 1.0]) == [
        "note: drafters.g was trained on answers sampled at T=0; at T=1 it drafts for text its data did not cover"]
    assert temperature_notes(heads, [0.0]) == []
