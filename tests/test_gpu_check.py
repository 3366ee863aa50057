"""`python -m eval.gpu_check` (make gpu-check) end to end on the CPU at a tiny size: the same command a GPU machine
runs, through a real `transformers serve`, features, training, evaluation and export."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_runs_the_whole_path_on_the_cpu(tmp_path):
    out = tmp_path / "check"
    r = subprocess.run([sys.executable, "-m", "eval.gpu_check", "target=embedded", "device=cpu", "conversations=8",
                        "max_new_tokens=16", "concurrency=4", "serve_args=[]", "train_steps=4", "max_length=128",
                        "eval_limit=1", "eval_max_new_tokens=8", f"out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert r.returncode == 0 and summary["ok"], r.stdout[-3000:] + r.stderr[-2000:]
    assert [s["name"] for s in summary["stages"]] == ["regenerate", "features", "train", "eval", "export"]
    f = summary["figures"]
    assert f["regenerate"]["conversations"] == 8 and f["regenerate"]["through"] == "transformers serve"
    assert f["features"]["bytes"] > 0 and f["train"]["global_step"] == 4
    assert all(v["greedy_identical"] == "1/1" for k, v in f["eval"].items() if k.endswith("T=0"))
    assert {"config.json", "model.safetensors", "README.md"} <= set(f["export"])


def test_gpu_check_refuses_a_missing_gpu_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = subprocess.run([sys.executable, "-m", "eval.gpu_check", "device=cuda", f"out_dir={tmp_path / 'x'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: device=") and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()
