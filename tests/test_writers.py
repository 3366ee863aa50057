"""Every command that writes a folder the user names goes through one guard (``data.errors.guard_out``): a folder
that is not ours, the source, the working directory, a file, an unwritable place are refused in one line before
any work, and nothing changes on disk. Writes are atomic and leave files and folders with the mode the umask
allows; caches that are damaged or cannot be written are rebuilt or named in one line."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

import test_fuzz
from conftest import train_overrides
from test_fuzz import E, invoke, snapshot

world = test_fuzz.world  # the fixture: one tiny EAGLE-3 and one tiny Medusa run, damaged files, a user's folder

UNWRITABLE = Path("/sys/draftsmith-guard/out")  # /sys refuses new files, even to root (a chmod would not)


def features_args(w, out):
    return train_overrides(w["target"], w["chats"], w["root"] / "runs/feat", steps=2) + [f"data.feature_dir={out}"]


# command -> (field, args without the output, args for the output ``out``)
COMMANDS = {
    "train.export": ("out", lambda w, out: [f"src={w['e3']}", f"out={out}"]),
    "train.ship": ("out", lambda w, out: [f"src={w['e3']}", f"out={out}"]),
    "eval.datastore": ("out", lambda w, out: [f"target.name_or_path={w['target']}", f"sources=[{w['chats']}]", f"out={out}"]),
    "eval": ("out_dir", lambda w, out: [a for a in E(w) if not a.startswith("out_dir=")] + [f"out_dir={out}"]),
    "eval.compare": ("run_dir", lambda w, out: [f"target.name_or_path={w['target']}", "train=false", f"run_dir={out}"]),
    "eval.curve": ("run_dir", lambda w, out: [f"target.name_or_path={w['target']}", f"run_dir={out}"]),
    "data.features": ("data.feature_dir", features_args),
    "data.regenerate": ("out_dir", lambda w, out: [f"target.name_or_path={w['target']}", f"data.source={w['chats']}",
                                                   f"out_dir={out}"]),
}
GUARD_CASES = {  # case -> (the output, the words of the error line)
    "user-folder": (lambda w, cwd: w["user"], "overwrite=true"),
    "a-file": (lambda w, cwd: w["user"] / "thesis.tex", "not a directory"),
    "working-dir": (lambda w, cwd: cwd, "working directory"),
    "unwritable": (lambda w, cwd: UNWRITABLE, "cannot write"),
}


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys")
@pytest.mark.parametrize("case", list(GUARD_CASES))
@pytest.mark.parametrize("module", list(COMMANDS))
def test_every_output_is_guarded(world, module, case, tmp_path, capsys):
    field, args = COMMANDS[module]
    where, expect = GUARD_CASES[case]
    out = where(world, tmp_path)
    before = snapshot(world["root"], tmp_path)
    code, err = invoke(module, args(world, out), tmp_path, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{field}=" in errors[0] and expect in errors[0], errors[0]
    after = snapshot(world["root"], tmp_path)
    assert not sorted(set(before.items()) ^ set(after.items()))


@pytest.mark.parametrize("module,args", [
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['e3']}"]),                     # the source itself
    ("train.ship", lambda w: [f"src={w['e3'] / 'draft'}", f"out={w['e3']}"]),           # a folder around the source
    ("train.export", lambda w: [f"src={w['e3']}", f"out={w['e3'] / 'draft'}"]),        # inside the source
    ("eval.datastore", lambda w: [f"target.name_or_path={w['target']}", f"sources=[{w['chats']}]",
                                  f"out={w['chats'].parent}", "overwrite=true"]),         # over the sources
])
def test_the_source_is_never_written_over(world, module, args, tmp_path, capsys):
    """Not even with overwrite=true: ``train.ship src=runs/X out=runs/X`` deleted the run's checkpoints and logs."""
    before = snapshot(world["root"], world["chats"].parent)
    code, err = invoke(module, args(world), tmp_path, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "source" in errors[0], err[-2000:]
    assert before == snapshot(world["root"], world["chats"].parent)


def test_a_folder_of_ours_is_replaced_and_overwrite_lifts_the_refusal(world, tmp_path, capsys):
    out = tmp_path / "shipped"
    code, err = invoke("train.ship", [f"src={world['e3']}", f"out={out}"], tmp_path, capsys)
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "report.json", "train_config.json"]
    code, err = invoke("train.ship", [f"src={world['e3']}", f"out={out}"], tmp_path, capsys)  # ours: replaced
    assert code == 0, err[-2000:]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    code, err = invoke("train.ship", [f"src={world['e3']}", f"out={mine}", "overwrite=true"], tmp_path, capsys)
    assert code == 0 and not (mine / "notes.txt").exists(), err[-2000:]


def test_ship_writes_draft_and_report_in_one_atomic_folder(world, tmp_path, monkeypatch):
    """A ship that fails while writing its report leaves the previous folder whole (it used to replace out/ first)."""
    import train.ship as ship_mod

    out = tmp_path / "shipped"
    ship_mod.ship(world["e3"], out)
    before = snapshot(out)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ship_mod, "write_json", boom)
    with pytest.raises(OSError):
        ship_mod.ship(world["e3"], out, dtype="float32")
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"


class FakeTrainer:
    """What ``ModelCheckpoint._save_checkpoint`` uses of a trainer; ``save_checkpoint`` writes a private file
    (as Lightning's does) and can fail half-way (a full disk)."""

    def __init__(self, fail: bool):
        self.fail, self.global_step, self.is_global_zero, self.loggers = fail, 7, True, []
        self.strategy = type("S", (), {"barrier": staticmethod(lambda *a: None)})()

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        os.write(fd, b"new-partial" if self.fail else b"new-complete")
        os.close(fd)
        if self.fail:
            raise OSError(28, "No space left on device")


def test_best_checkpoint_is_written_to_a_sibling_and_renamed(tmp_path):
    from data.errors import umask
    from train.callbacks import AtomicModelCheckpoint

    cb = AtomicModelCheckpoint(dirpath=str(tmp_path), filename="best")
    best = tmp_path / "best.ckpt"
    best.write_bytes(b"old-complete")
    with pytest.raises(OSError):
        cb._save_checkpoint(FakeTrainer(fail=True), str(best))
    assert best.read_bytes() == b"old-complete"  # never a partial file under the final name
    cb._save_checkpoint(FakeTrainer(fail=False), str(best))
    assert best.read_bytes() == b"new-complete"
    assert stat.S_IMODE(best.stat().st_mode) == 0o666 & ~umask()


def test_outputs_have_the_mode_the_umask_allows(tiny_target_dir, tiny_chats, tmp_path, monkeypatch):
    """Under umask 027: files 0640 and folders 0750 everywhere (a tempfile's 0600 made weights unreadable to a
    serving container running as another user; folders were 0755 whatever the umask)."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from eval.datastore import write_datastore
    from models.formats import export_draft
    from train.__main__ import run
    from train.ship import ship

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o027)
    try:
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            run(compose("train", overrides=train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=2)))
        ship(tmp_path / "run", tmp_path / "shipped")
        export_draft(str(tmp_path / "run"), "speculators", str(tmp_path / "exported"))
        import torch

        write_datastore(tmp_path / "store", torch.arange(10), {"target": {}})
    finally:
        os.umask(old)
    wrong = []
    for p in [tmp_path / n for n in ("run", "shipped", "exported", "store", "cache")]:
        for q in [p, *p.rglob("*")]:
            want = 0o750 if q.is_dir() else 0o640
            if stat.S_IMODE(q.stat().st_mode) != want:
                wrong.append(f"{q.relative_to(tmp_path)} {oct(stat.S_IMODE(q.stat().st_mode))}")
    assert (tmp_path / "run/checkpoints/best.ckpt").exists() and (tmp_path / "run/draft/model.safetensors").exists()
    assert not wrong, wrong[:8]


# -- caches ---------------------------------------------------------------------------------------------------

def test_damaged_conversation_cache_is_rebuilt_without_leftovers(tiny_chats, tmp_path, capsys):
    from data.conversations import load_conversations

    n = len(load_conversations(str(tiny_chats), "train", 0.2, cache_dir=tmp_path, verbose=False))
    entries = tmp_path / "conversations"
    (entry,) = list(entries.iterdir())
    for damage in ("info", "arrow", "empty"):
        if damage == "info":
            (entry / "dataset_info.json").unlink()
        elif damage == "arrow":
            arrow = next(entry.glob("data-*.arrow"))
            arrow.write_bytes(arrow.read_bytes()[:100])
        else:
            shutil.rmtree(entry)
            entry.mkdir()
        for _ in range(2):  # the second attempt finds a good entry: no copy of the dataset per attempt
            assert len(load_conversations(str(tiny_chats), "train", 0.2, cache_dir=tmp_path, verbose=False)) == n
        assert [p.name for p in entries.iterdir()] == [entry.name], damage
    assert "damaged" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["DRAFTSMITH_CACHE", "HOME"])
def test_unwritable_cache_is_one_line(tiny_chats, tmp_path, monkeypatch, where):
    from data.conversations import load_conversations
    from data.errors import UserError

    if where == "HOME":
        monkeypatch.delenv("DRAFTSMITH_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(UNWRITABLE))
    else:
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(UNWRITABLE))
    with pytest.raises(UserError, match="cache folder .*DRAFTSMITH_CACHE"):
        load_conversations(str(tiny_chats), "train", 0.2, verbose=False)


def test_read_only_cache_serves_what_it_holds_and_refuses_a_new_entry(tiny_chats, tmp_path, monkeypatch):
    """A cache whose folder cannot be written: a held entry loads, with any held-out fraction and tokenised with a
    new max_length, and nothing is written beside it (it is read into memory); a new source is one line naming the
    folder."""
    import data.errors as errors
    from conftest import make_tokenizer
    from data.conversations import load_conversations
    from data.errors import UserError
    from data.prepare import tokenize_split

    load_conversations(str(tiny_chats), "train", 0.2, cache_dir=tmp_path, verbose=False)
    entries = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    real = errors.unwritable
    monkeypatch.setattr(errors, "unwritable", lambda d: "Read-only file system" if Path(d).is_relative_to(tmp_path) else real(d))
    os.chmod(tmp_path / "conversations", 0o555)
    try:
        assert len(load_conversations(str(tiny_chats), "heldout", 0.3, cache_dir=tmp_path, verbose=False)) > 0
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
        assert len(tokenize_split(make_tokenizer("embedded"), str(tiny_chats), "train", 0.2, max_length=40, verbose=False))
        assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == entries  # nothing written
        other = tmp_path.parent / f"{tmp_path.name}-other.jsonl"
        other.write_text(tiny_chats.read_text().splitlines()[0] + "\n")
        with pytest.raises(UserError, match="cache folder .*conversations.*Read-only"):
            load_conversations(str(other), "train", 0.2, cache_dir=tmp_path, verbose=False)
    finally:
        os.chmod(tmp_path / "conversations", 0o755)


# -- eval.compare and eval.curve reuse only what was made with the same settings ---------------------------------

def test_compare_retrains_a_family_whose_overrides_changed(tmp_path, monkeypatch):
    import subprocess

    from eval.compare import train_family

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = Path(next(c for c in cmd if c.startswith("hydra.run.dir=")).split("=", 1)[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"cmd": cmd[3:]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    train_family("mtp", ["draft=mtp"], ["trainer.max_steps=4"], tmp_path)
    assert len(calls) == 1 and "ckpt_path=last" in calls[0]
    train_family("mtp", ["draft=mtp"], ["trainer.max_steps=4"], tmp_path)  # unchanged: reused
    assert len(calls) == 1
    train_family("mtp", ["draft=mtp", "draft.num_heads=3"], ["trainer.max_steps=4"], tmp_path)  # changed: trained again
    assert len(calls) == 2 and "overwrite=true" in calls[1] and "ckpt_path=null" in calls[1]
    assert "draft.num_heads=3" in json.loads((tmp_path / "mtp/result.json").read_text())["cmd"]


def test_curve_recomputes_a_point_whose_settings_changed(world, tmp_path, monkeypatch, capsys):
    import eval.curve as curve

    trained = []
    result = json.loads((world["e3"] / "result.json").read_text())

    def fake_point(family, overrides, shared, run, steps, last_budget, schedule, unit="steps", fresh=False):
        trained.append((steps, list(overrides), fresh))
        return {"result": {**result, "global_step": steps}, "resumed_from_step": 0}

    monkeypatch.setattr(curve, "train_point", fake_point)
    base = [f"target.name_or_path={world['target']}", "eval_set=[jsonl]", f"eval_set.jsonl.path={world['bad'] / 'one.jsonl'}",
            "limit=1", "max_new_tokens=3", "temperatures=[0]", "budgets=[2]", "baselines.ngram=null",
            f"run_dir={tmp_path / 'curve'}"]
    (world["bad"] / "one.jsonl").write_text(json.dumps({"prompt": "Hello!"}) + "\n")
    for more, want in (([], [(2, ["experiment=eagle3_quick"], False)]),
                       ([], []),                                                         # unchanged: reused
                       (["families.eagle3=['experiment=eagle3_quick','draft.ttt_steps=2']"],
                        [(2, ["experiment=eagle3_quick", "draft.ttt_steps=2"], True)]),  # changed: again
                       (["families.eagle3=['experiment=eagle3_quick','draft.ttt_steps=2']", "max_new_tokens=2"],
                        [(2, ["experiment=eagle3_quick", "draft.ttt_steps=2"], True)])):  # eval settings changed
        trained.clear()
        code, err = invoke("eval.curve", base + more, tmp_path, capsys)
        assert code == 0, err[-2000:]
        assert trained == want


@pytest.mark.parametrize("damage", ["truncated-weights", "no-tokenizer", "no-record"])
def test_damaged_gguf_conversion_is_converted_again(tmp_path, monkeypatch, damage, capsys):
    """A converted folder with truncated weights or a missing tokenizer made every run end in a traceback."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from tests.test_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import gguf as mg

    path = write_tiny_gguf(tmp_path / "tiny.F32.gguf")[0]
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    out = mg.converted_dir(path)
    if damage == "truncated-weights":
        w = out / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "no-tokenizer":
        (out / "tokenizer.json").unlink()
    else:
        (out / "draftsmith_gguf.json").write_text('{"source": ')
    assert mg.intact(out) is not None
    assert mg.converted_dir(path) == out and mg.intact(out) is None
    assert "converting again" in capsys.readouterr().out
    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_gguf_conversion_into_an_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from tests.test_gguf import write_tiny_gguf

    from data.errors import UserError
    from models import gguf as mg

    path = write_tiny_gguf(tmp_path / "tiny.F32.gguf")[0]
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(UNWRITABLE))
    with pytest.raises(UserError, match="cache folder .*gguf.*DRAFTSMITH_CACHE"):
        mg.converted_dir(path)
