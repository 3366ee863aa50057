"""last.ckpt is the last step, best.ckpt the best; a stopped-and-resumed run equals an uninterrupted one;
a run folder is locked by its owner; damaged or foreign checkpoints are refused before anything is written."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import compose_train, train_overrides


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "draft/model.safetensors"))


def last_state(run_dir):
    return torch.load(run_dir / "checkpoints/last.ckpt", weights_only=False)


def test_last_is_last_step_and_best_is_best(tiny_target_dir, tiny_chats, tmp_path):
    from train.__main__ import run

    result = run(compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=6)))
    assert result["global_step"] == 6
    last = last_state(tmp_path / "run")
    assert last["global_step"] == 6  # not the step of the best validation
    best = torch.load(tmp_path / "run/checkpoints/best.ckpt", weights_only=False)
    ck = next(v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert ck["best_model_path"].endswith("best.ckpt") and best["global_step"] in (2, 4, 6)
    assert float(ck["best_model_score"]) >= last["val_metrics"]["val/acc_len"] - 1e-9  # best is the best validation
    # rerunning with ckpt_path=last resumes at 6 and trains nothing more; result.json keeps the val metrics
    again = run(compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=6) + ["ckpt_path=last"]))
    assert again["global_step"] == 6 and again["train_tokens"] == result["train_tokens"]
    assert again["val/acc_len"] == pytest.approx(result["val/acc_len"])
    saved = json.loads((tmp_path / "run/result.json").read_text())
    assert "val/acc_len" in saved and "val/acc_0" in saved


@pytest.mark.parametrize("draft", ["eagle3", "dflash"])
def test_stopped_and_resumed_equals_uninterrupted(tiny_target_dir, tiny_chats, tmp_path, draft):
    """stop_at_step=4 then ckpt_path=last to 14 (crossing an epoch) == straight to 14: tokens, weights, val."""
    from train.__main__ import run

    def over(d, *more):
        o = train_overrides(tiny_target_dir, tiny_chats, tmp_path / d, steps=14)
        if draft != "eagle3":
            o = [x for x in o if not x.startswith("draft.ttt_steps")]
        return o + [f"draft={draft}", *more]

    straight = run(compose_train(over("straight")))
    first = run(compose_train(over("resumed", "stop_at_step=4")))
    assert first["global_step"] == 4 and last_state(tmp_path / "resumed")["global_step"] == 4
    resumed = run(compose_train(over("resumed", "ckpt_path=last")))
    assert resumed["global_step"] == straight["global_step"] == 14
    assert resumed["train_tokens"] == straight["train_tokens"]
    assert resumed["train_positions"] == straight["train_positions"] >= straight["train_tokens"]  # padding included
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(f"{draft}: tokens {straight['train_tokens']} vs {resumed['train_tokens']}, max weight diff {diff:.2e}")
    assert diff < 1e-5
    assert resumed["val/acc_len"] == pytest.approx(straight["val/acc_len"], abs=1e-6)


def test_training_again_into_a_finished_run_is_refused(tiny_target_dir, tiny_chats, tmp_path):
    """Without ckpt_path (or with ckpt_path=last and no last.ckpt) a second run into a finished run's folder used to
    start from scratch and replace best.ckpt, last.ckpt and the export with only a warning."""
    from data.errors import UserError
    from train.__main__ import run

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=2)
    run(compose_train(over))
    files = ["checkpoints/best.ckpt", "checkpoints/last.ckpt", "draft/model.safetensors", "result.json"]
    stamp = {f: (tmp_path / "run" / f).stat().st_mtime_ns for f in files}
    with pytest.raises(UserError, match="holds a run .*ckpt_path=last.*overwrite=true"):
        run(compose_train(over))
    (tmp_path / "run/checkpoints/last.ckpt").unlink()
    del stamp["checkpoints/last.ckpt"]
    with pytest.raises(UserError, match="last.ckpt is missing"):
        run(compose_train(over + ["ckpt_path=last"]))
    assert stamp == {f: (tmp_path / "run" / f).stat().st_mtime_ns for f in stamp}
    again = run(compose_train(over + ["overwrite=true", "trainer.max_steps=4"]))  # from scratch, on purpose
    assert again["global_step"] == 4 and last_state(tmp_path / "run")["global_step"] == 4


@pytest.mark.parametrize("change,refused", [
    (["optim.lr=0.002"], "optim.lr"),                                       # the optimiser keeps the old LR: refused
    (["optim.min_lr_ratio=0.1"], "optim.min_lr_ratio"),                     # the schedule: refused
    (["target.tap_layers=[0,2,1]"], "target.tap_layers"),                   # the export would name taps it never saw
    (["data.heldout_fraction=0.3"], "data.heldout_fraction"),               # other data
    (["draft.ttt_steps=2"], "draft.ttt_steps"),
    (["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=2"], None),  # may change
])
def test_resume_checks_the_recorded_config(tiny_target_dir, tiny_chats, tmp_path, change, refused):
    from data.errors import UserError
    from train.__main__ import run

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=4)
    run(compose_train(over + ["stop_at_step=2"]))
    assert last_state(tmp_path / "run")["run_config"]["optim"]["lr"] == pytest.approx(1e-3)
    if refused:
        with pytest.raises(UserError, match=f"trained with other settings.*{refused}"):
            run(compose_train(over + ["ckpt_path=last", *change]))
        assert last_state(tmp_path / "run")["global_step"] == 2
    else:
        assert run(compose_train(over + ["ckpt_path=last", *change]))["global_step"] == 6
