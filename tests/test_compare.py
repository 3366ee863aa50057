"""`python -m eval.compare` end to end on a tiny target: two families trained on one budget, one table."""
from __future__ import annotations

import json
import subprocess
import sys

from omegaconf import OmegaConf

from conftest import ROOT, train_overrides


def test_compare_trains_resumes_and_tabulates(tiny_target_dir, tiny_chats, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello! How can I help you today?"}\n')
    shared = [o for o in train_overrides(tiny_target_dir, tiny_chats, tmp_path / "unused", steps=2)
              if not o.startswith(("run_dir=", "draft.ttt_steps="))]
    args = [sys.executable, "-m", "eval.compare", f"run_dir={tmp_path / 'cmp'}", f"target.name_or_path={tiny_target_dir}",
            "train_overrides=[" + ",".join(f"'{o}'" for o in shared) + "]",
            "families.eagle3=['draft=eagle3','draft.ttt_steps=2']", "families.dflash=['draft=dflash','draft.block_size=4']",
            *[f"families.{f}=null" for f in OmegaConf.load(ROOT / "conf/compare.yaml").families if f not in ("eagle3", "dflash")],
            "baselines.draft_model=null", "eval_set=[jsonl]", f"eval_set.jsonl.path={prompts}",
            "max_new_tokens=8", "k=3", "limit=1"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "cmp/eval/compare.json").read_text())
    assert set(out["trained"]) == {"eagle3", "dflash"}
    for tr in out["trained"].values():  # the same budget for every family
        assert tr["global_step"] == 2 and tr["trainable_params"] > 0 and tr["train_time_s"] > 0
    row = out["results"]["prompts"]["T=0"]
    assert set(row) == {"plain", "ngram", "eagle3", "dflash"}
    assert all(row[d]["greedy_identical"] == "1/1" for d in ("ngram", "eagle3", "dflash"))
    table = (tmp_path / "cmp/eval/compare.md").read_text()
    assert "| eagle3 |" in table and "trainable params" in table and (tmp_path / "cmp/eval/acceptance.png").exists()
    # a second run finds both families trained and does not train again
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "== training" not in r.stdout, r.stdout[-2000:]


def test_budget_time_gives_every_family_the_same_seconds():
    import pytest

    from data.errors import UserError
    from eval.compare import budget_overrides

    assert budget_overrides("steps", 3600) == []
    assert budget_overrides("time", 600) == ["time_budget_s=600.0", "trainer.max_steps=10000000"]
    with pytest.raises(UserError, match="budget='tokens'"):
        budget_overrides("tokens", 600)
    with pytest.raises(UserError, match="time_budget_s=None"):
        budget_overrides("time", None)
