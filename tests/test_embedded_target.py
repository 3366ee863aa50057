"""The embedded-target recipe (micro version, seconds) and the shipped embedded target."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import ROOT
from models.target import EMBEDDED_PATH, FrozenTarget, load_tokenizer


def compose_recipe(overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("embedded_target", overrides=overrides)


@pytest.mark.slow
def test_micro_recipe_trains_exports_and_resumes(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.embedded_target import run

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    cfg = compose_recipe(["experiment_target=micro", f"run_dir={run_dir}", "trainer.max_steps=12", "data.max_conversations=60"])
    report = run(cfg)
    assert report["steps"] == 12 and report["train_tokens_seen"] == 12 * 4 * 64
    assert report["heldout_loss"] < 6.3  # below uniform over 512 tokens (ln 512 = 6.24) plus slack: it learned something
    export = Path(cfg.export_dir)
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert model.dtype == torch.bfloat16 and tok.convert_tokens_to_ids("<|mask|>") == model.config.mask_token_id
    assert json.loads((export / "report.json").read_text())["parameters"] == sum(p.numel() for p in model.parameters())
    # resume: a longer schedule continues from the last checkpoint
    cfg2 = compose_recipe(["experiment_target=micro", f"run_dir={run_dir}", "trainer.max_steps=16", "data.max_conversations=60",
                           "ckpt_path=last"])
    report2 = run(cfg2)
    assert report2["steps"] == 16 and report2["train_tokens_seen"] == 16 * 4 * 64


needs_embedded = pytest.mark.skipif(not (EMBEDDED_PATH / "config.json").exists(), reason="embedded target not built yet")


@needs_embedded
def test_shipped_embedded_target():
    size = sum(f.stat().st_size for f in EMBEDDED_PATH.iterdir())
    assert size <= 25 * 2**20
    target = FrozenTarget("embedded")
    tok = load_tokenizer("embedded")
    assert tok.chat_template and tok.convert_tokens_to_ids("<|mask|>") == target.config.mask_token_id
    report = json.loads((EMBEDDED_PATH / "report.json").read_text())
    assert report["parameters"] == sum(p.numel() for p in target.parameters())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = target(ids, return_logits=True)
    assert torch.isfinite(out.logits).all()
