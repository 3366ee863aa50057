"""``python -m eval.results``: the results page renders from its JSON, refuses what it cannot render, and the committed
page and README are in sync with docs/results/*.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from data.errors import UserError
from eval.results import BEGIN, END, run

EVAL = {"title": "A tiny head", "date": "2026-01-02", "machine": "a test box", "load": "idle", "command": "python -m eval x=1",
        "source": "a fixture", "asset": "assets/tiny", "drafter": "h", "head": "tiny",
        "columns": {"ngram": "n-gram", "h": "the head"},
        "evaluation": {"results": {"mtbench": {"T=0": {"ngram": {"tau": 1.234, "speedup": 1.111}, "h": {"tau": 2.345, "speedup": 1.5}},
                                               "T=1": {"h": {"tau": 1.75, "speedup": 1.25}}},
                                   "humaneval": {"T=0": {"h": {"tau": 3.125, "speedup": 1.875}}}}}}
TABLE = {"title": "A printed table", "date": "2026-01-03", "machine": "another box", "load": "busy", "command": "python -m eval y=2",
         "source": "transcribed from the evaluation's printed table", "table": {"header": ["a", "b"], "rows": [["1", "2"]]}}


def page(path: Path) -> Path:
    path.write_text(f"# intro kept\n\n{BEGIN}\nstale\n{END}\nprose kept\n")
    return path


def test_renders_every_table_and_the_heads_lines_from_json(tmp_path):
    src = tmp_path / "results"
    src.mkdir()
    (src / "a.json").write_text(json.dumps(EVAL))
    (src / "b.json").write_text(json.dumps(TABLE))
    out, readme = page(tmp_path / "results.md"), page(tmp_path / "README.md")
    assert run(src, out, readme) == [out, readme]
    text = out.read_text()
    assert text.startswith("# intro kept") and text.rstrip().endswith("prose kept") and "stale" not in text
    for m in (EVAL, TABLE):
        assert f"### {m['title']}" in text and m["command"] in text and f"{m['date']}, {m['machine']}, {m['load']}" in text
    r = EVAL["evaluation"]["results"]
    ng, h = r["mtbench"]["T=0"]["ngram"], r["mtbench"]["T=0"]["h"]
    assert f"| MT-Bench | 0 | {ng['tau']:.2f} / {ng['speedup']:.2f}× | {h['tau']:.2f} / {h['speedup']:.2f}× |" in text
    assert "| HumanEval | 0 |  | " in text and "| 1 | 2 |" in text  # a drafter missing from a row: an empty cell
    line = [x for x in readme.read_text().splitlines() if x.startswith("- `assets/tiny`")]
    taus = [r["mtbench"]["T=0"]["h"]["tau"], r["humaneval"]["T=0"]["h"]["tau"]]
    assert len(line) == 1 and f"T=0: τ {min(taus):.2f}–{max(taus):.2f}" in line[0] and EVAL["date"] in line[0]
    assert run(src, out, readme, check=True) == []  # rendered: in sync
    (src / "b.json").write_text(json.dumps({**TABLE, "table": {"header": ["a", "b"], "rows": [["1", "3"]]}}))
    assert run(src, out, readme, check=True) == [out] and "| 1 | 2 |" in out.read_text()  # check writes nothing


def test_refuses_a_measurement_without_its_when_where_how(tmp_path):
    src = tmp_path / "results"
    src.mkdir()
    (src / "a.json").write_text(json.dumps({k: v for k, v in TABLE.items() if k != "machine"}))
    with pytest.raises(UserError, match="a.json: missing machine"):
        run(src, page(tmp_path / "r.md"))
    (src / "a.json").write_text(json.dumps(TABLE))
    (tmp_path / "nomarkers.md").write_text("# no markers\n")
    with pytest.raises(UserError, match="nomarkers.md: needs one line"):
        run(src, tmp_path / "nomarkers.md")


def test_the_committed_pages_are_in_sync_with_their_json():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "eval.results", "check=true"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_check_exits_1_with_one_line_when_a_page_drifts(tmp_path):
    src = tmp_path / "results"
    src.mkdir()
    (src / "b.json").write_text(json.dumps(TABLE))
    out = page(tmp_path / "results.md")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "eval.results", f"src={src}", f"out={out}", "readme=null"]
    stale = subprocess.run([*args, "check=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert stale.returncode == 1 and len(stale.stderr.strip().splitlines()) == 1 and str(out) in stale.stderr
    assert "stale" in out.read_text()  # check wrote nothing
    assert subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).returncode == 0
    again = subprocess.run([*args, "check=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    (src / "c.json").write_text("{not json")
    bad = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "c.json" in lines[0]
