"""The unit-sized guards: run-folder lock, leftover sweep, export's out= guard, prompt-length policy,
blank prompts, optimiser values, and the one-line report of a config that does not compose."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from data.errors import UserError


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_run_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path, capsys):
    from train.rundir import LOCK, RunLock

    run = tmp_path / "run"
    run.mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": "earlier"}
    (run / LOCK).write_text(json.dumps(holder))
    with pytest.raises(UserError, match=rf"in use by pid {os.getppid()} on {socket.gethostname()}"):
        RunLock(run).acquire()
    assert json.loads((run / LOCK).read_text()) == holder  # the holder's lock is left alone
    (run / LOCK).write_text(json.dumps({**holder, "pid": dead_pid()}))
    with RunLock(run) as lock:
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid() and lock.held
        assert "stale lock" in capsys.readouterr().out
    assert not (run / LOCK).exists()  # released
    (run / LOCK).write_text(json.dumps({**holder, "host": "elsewhere"}))
    with pytest.raises(UserError, match="on host elsewhere"):
        RunLock(run).acquire()


def test_second_train_into_a_locked_run_is_refused(tiny_target_dir, tiny_chats, tmp_path, monkeypatch):
    """Two runs into one folder: the second gets one error line naming the holder, and writes nothing."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT, train_overrides
    from train.__main__ import run
    from train.rundir import LOCK

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "run"
    d.mkdir()
    (d / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": "now"}))
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=train_overrides(tiny_target_dir, tiny_chats, d, steps=2))
    with pytest.raises(UserError, match=f"in use by pid {os.getppid()}"):
        run(cfg)
    assert sorted(p.name for p in d.iterdir()) == [LOCK]


def test_leftovers_of_killed_writes_are_swept(tmp_path):
    from train.rundir import sweep_leftovers

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".draft.tmp-abc123").mkdir()
    (run / ".draft.tmp-abc123/model.safetensors").write_bytes(b"half")
    (run / ".draft.old-999").mkdir()
    (run / ".result.json.tmp-x1").write_text("{")
    (run / "checkpoints/.last.ckpt.tmp-42").write_bytes(b"half")
    (run / ".hidden-user-file").write_text("keep")
    (run / "draft").mkdir()
    gone = sweep_leftovers(run)
    assert len(gone) == 4
    assert sorted(p.name for p in run.iterdir()) == [".hidden-user-file", "checkpoints", "draft"]
    assert list((run / "checkpoints").iterdir()) == []
    # an export's leftovers: only those of that out=
    (tmp_path / ".x-speculators.tmp-1").mkdir()
    (tmp_path / ".other.tmp-1").mkdir()
    sweep_leftovers(tmp_path, names=["x-speculators"])
    assert not (tmp_path / ".x-speculators.tmp-1").exists() and (tmp_path / ".other.tmp-1").exists()


def test_export_out_guard(tmp_path, monkeypatch):
    from train.export import check_out

    check_out(tmp_path / "new", overwrite=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty", overwrite=False)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "draftsmith": {"format": "draftsmith-draft/1"}}))
    (ours / "model.safetensors").write_bytes(b"x")
    check_out(ours, overwrite=False)  # an export of ours is replaced
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an export of ours.*overwrite=true"):
        check_out(user, overwrite=False)
    check_out(user, overwrite=True)
    (ours / "extra.txt").write_text("a user file inside an export")
    with pytest.raises(UserError, match="not an export of ours"):
        check_out(ours, overwrite=False)
    with pytest.raises(UserError, match="not a directory"):
        check_out(user / "notes.txt", overwrite=True)
    monkeypatch.chdir(user)
    with pytest.raises(UserError, match="working directory"):
        check_out(tmp_path, overwrite=True)


def test_prompt_length_policy():
    from eval.sets import PromptLengthPolicy

    p = PromptLengthPolicy(None, context=64, max_new_tokens=16, k=5)
    assert p.limit == 64 - 16 - 5 - 1
    ids = torch.arange(100)
    assert torch.equal(p(ids, ("s", 0, 0)), ids[-p.limit:])  # truncated from the left
    p(ids, ("s", 0, 0))
    p(ids[:10], ("s", 1, 0))
    p(ids, ("t", 3, 1))
    assert p.counts() == {"s": 1, "t": 1}
    assert PromptLengthPolicy(8, 64, 16, 5).limit == 8
    with pytest.raises(UserError, match="max_prompt_tokens=60"):
        PromptLengthPolicy(60, 64, 16, 5)
    with pytest.raises(UserError, match="max_prompt_tokens=0"):
        PromptLengthPolicy(0, 64, 16, 5)
    with pytest.raises(UserError, match="no room"):
        PromptLengthPolicy(None, 64, 60, 5)


def test_blank_prompts_are_refused_with_their_reason(tmp_path):
    from eval.sets import JsonlSet

    cases = {'{"prompt": "   "}': "blank prompt",
             json.dumps({"messages": [{"role": "user", "content": " \n "}]}): "blank user turn",
             json.dumps({"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]}): "blank user turn"}
    for line, reason in cases.items():
        f = tmp_path / "p.jsonl"
        f.write_text(line + "\n")
        with pytest.raises(UserError, match=reason):
            JsonlSet(str(f)).load()
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"p.jsonl:2: not UTF-8"):
        JsonlSet(str(f)).load()


@pytest.mark.parametrize("kw,field", [({"lr": -1}, "optim.lr"), ({"lr": float("nan")}, "optim.lr"), ({"lr": "fast"}, "optim.lr"),
                                      ({"weight_decay": -1}, "weight_decay"), ({"betas": [0.9]}, "betas"),
                                      ({"betas": [0.9, 1.0]}, "betas"), ({"warmup_ratio": -0.1}, "warmup_ratio"),
                                      ({"min_lr_ratio": 2}, "min_lr_ratio")])
def test_optimiser_values_are_checked(kw, field):
    from train.module import check_optim

    args = {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95), "warmup_ratio": 0.04, "min_lr_ratio": 0.0, **kw}
    with pytest.raises(UserError, match=field):
        check_optim(**args)
