"""A battery of damaged files and bad values thrown at every CLI.

Each case runs the command's real entry point (``run_main(main)``: Hydra composition, the ``cli`` wrapper)
in this process, with the working directory in a fresh temporary folder, and asserts: exit code 2, exactly one
``error:`` line (containing the expected words), no traceback, and nothing changed on disk (the fixtures, the
working directory) except Hydra's own output folder. Damaged inputs are copies of real outputs of a tiny run
(a trained draft, its checkpoints) cut short, overwritten with random bytes, or swapped for another family's.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import train_overrides

# -- fixtures: one tiny EAGLE-3 run and one tiny Medusa run, and damaged copies of their files ----------------


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_target_dir, tiny_chats):
    """Real outputs to damage: runs/e3 (EAGLE-3), runs/md (Medusa), then the damaged files themselves."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from train.__main__ import run

    root = tmp_path_factory.mktemp("fuzz")
    os.environ["DRAFTSMITH_CACHE"] = str(root / "cache")
    for name, draft in (("e3", "eagle3"), ("md", "medusa")):
        over = train_overrides(tiny_target_dir, tiny_chats, root / "runs" / name, steps=2) + [f"draft={draft}"]
        if draft != "eagle3":
            over = [o for o in over if not o.startswith("draft.ttt_steps")]
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            run(compose("train", overrides=over))
    bad = root / "bad"
    bad.mkdir()
    e3 = root / "runs/e3"
    ckpt = (e3 / "checkpoints/last.ckpt").read_bytes()
    (bad / "truncated.ckpt").write_bytes(ckpt[: len(ckpt) // 2])
    (bad / "random.ckpt").write_bytes(os.urandom(4096))
    (bad / "text.ckpt").write_text("not a checkpoint\n")
    (bad / "empty.ckpt").write_bytes(b"")
    for name, damage in (("draft_truncated", lambda b: b[: len(b) // 3]), ("draft_random", lambda b: os.urandom(len(b))),
                         ("draft_header", lambda b: b[:8] + b"{garbage" + b[16:])):
        d = bad / name
        shutil.copytree(e3 / "draft", d)
        (d / "model.safetensors").write_bytes(damage((d / "model.safetensors").read_bytes()))
    d = bad / "draft_badjson"
    shutil.copytree(e3 / "draft", d)
    (d / "config.json").write_text('{"format": "draftsmith-draft/1", ')
    d = bad / "draft_noweights"
    shutil.copytree(e3 / "draft", d)
    (d / "model.safetensors").unlink()
    (bad / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (bad / "blank.jsonl").write_text('{"prompt": "   "}\n')
    (bad / "blank_turn.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "  "}]}) + "\n")
    (bad / "notjson.jsonl").write_text('{"prompt": "a"\n')
    (bad / "empty.jsonl").write_text("")
    (bad / "wrongshape.jsonl").write_text("[1, 2, 3]\n")
    (bad / "chats_latin1.jsonl").write_bytes(
        (json.dumps({"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]})[:-3]
         + "\xe9\"}]}\n").encode("latin-1"))
    (bad / "chats_cut.json").write_text('[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"fr')
    (bad / "results_garbage.json").write_text("{not json")
    (bad / "results_empty.json").write_text("{}")
    (bad / "other_chats.jsonl").write_text("".join(Path(tiny_chats).read_text().splitlines(keepends=True)[:-1]))
    locked = root / "runs/locked"
    locked.mkdir()
    (locked / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": __import__("socket").gethostname(), "started": "now"}))
    user = root / "userfiles"
    user.mkdir()
    (user / "thesis.tex").write_text("my thesis\n")
    return {"root": root, "target": tiny_target_dir, "chats": tiny_chats, "bad": bad, "e3": e3, "md": root / "runs/md",
            "user": user, "locked": locked}


def snapshot(*roots: Path) -> dict:
    out = {}
    for r in roots:
        for p in sorted(Path(r).rglob("*")):
            if p.is_file() and "hydra-out" not in p.parts and "cache" not in p.relative_to(r).parts[:1]:
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def invoke(module: str, args: list[str], cwd: Path, capsys) -> tuple[int, str]:
    """``python -m <module> <args>`` in this process: (exit code, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    from data.errors import run_main

    mod = importlib.import_module(module if module not in ("train", "eval") else f"{module}.__main__")
    # Hydra resolves config_path="../conf" from the (unwrapped) task function's file only when its module is
    # __main__, as under `python -m`; here it is imported, so it says __main__ for the call
    task = mod.main
    while hasattr(task, "__wrapped__"):
        task = task.__wrapped__
    saved_module, task.__module__ = task.__module__, "__main__"
    GlobalHydra.instance().clear()
    argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [module, *args, f"hydra.run.dir={cwd / 'hydra-out'}"]
    os.chdir(cwd)
    capsys.readouterr()
    try:
        run_main(mod.main)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        task.__module__ = saved_module
        os.chdir(old_cwd)
        GlobalHydra.instance().clear()
    return code, capsys.readouterr().err


def T(w, run="e3", **kw):
    """The tiny training overrides into an existing run folder (so nothing may change there)."""
    over = train_overrides(w["target"], w["chats"], w[run], steps=2)
    return over


def E(w, *more):
    """python -m eval on the tiny target, no baseline drafters, one tiny jsonl set."""
    return [f"target.name_or_path={w['target']}", "drafters.ngram=null", "drafters.draft_model=null", "drafters.eagle3=null",
            "eval_set=[jsonl]", f"eval_set.jsonl.path={w['bad'] / 'blank.jsonl'}", "limit=1", "max_new_tokens=4",
            "temperatures=[0]", f"out_dir={w['root'] / 'eval-out'}", *more]


def P(w, *more):
    return [f"target.name_or_path={w['target']}", f"data.source={w['chats']}", *more]


CASES = [
    # -- python -m train: bad values ------------------------------------------------------------------------
    ("train", lambda w: T(w) + ["optim.lr=-1"], "optim.lr"),
    ("train", lambda w: T(w) + ["optim.lr=0"], "optim.lr"),
    ("train", lambda w: T(w) + ["optim.betas=[1.5,0.9]"], "optim.betas"),
    ("train", lambda w: T(w) + ["optim.warmup_ratio=2"], "optim.warmup_ratio"),
    ("train", lambda w: T(w) + ["optim.weight_decay=-0.1"], "optim.weight_decay"),
    ("train", lambda w: T(w) + ["data.batch_size=0"], "batch_size"),
    ("train", lambda w: T(w) + ["data.max_length=100000"], "max_position_embeddings"),
    ("train", lambda w: T(w) + ["draft.no_such_key=1"], "no_such_key"),
    ("train", lambda w: T(w) + ["no_such_top_level=1"], "no_such_top_level"),
    ("train", lambda w: T(w) + ["draft=no_such_family"], "no_such_family"),
    ("train", lambda w: T(w) + ["trainer.max_steps=[1"], "max_steps"),
    # -- python -m train: damaged / foreign checkpoints (the run's config and logs untouched) -----------------
    ("train", lambda w: T(w) + [f"ckpt_path={w['bad'] / 'truncated.ckpt'}"], "ckpt_path"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['bad'] / 'random.ckpt'}"], "ckpt_path"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['bad'] / 'text.ckpt'}"], "ckpt_path"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['bad'] / 'empty.ckpt'}"], "ckpt_path"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['md'] / 'checkpoints/last.ckpt'}"], "medusa"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['e3'] / 'checkpoints/last.ckpt'}", "draft.draft_vocab_size=64"], "shape"),
    ("train", lambda w: T(w) + ["ckpt_path=/nonexistent/x.ckpt"], "ckpt_path"),
    ("train", lambda w: T(w) + [f"ckpt_path={w['bad']}"], "ckpt_path"),
    ("train", lambda w: T(w, run="locked"), "in use by pid"),
    # -- python -m train: values checked where they are read --------------------------------------------------
    ("train", lambda w: T(w) + ["stop_at_step=0"], "stop_at_step"),
    ("train", lambda w: T(w) + ["stop_at_step=-3"], "stop_at_step"),
    ("train", lambda w: T(w) + ["seed=-1"], "seed"),
    ("train", lambda w: T(w) + ["draft.draft_vocab_size=0"], "draft_vocab_size"),
    ("train", lambda w: T(w) + ["draft.draft_vocab_size=-5"], "draft_vocab_size"),
    # -- python -m train: a finished run trained again from scratch; a resume with other settings ---------------
    ("train", lambda w: T(w), "ckpt_path=last"),
    ("train", lambda w: T(w) + ["ckpt_path=last", "optim.lr=0.002"], "optim.lr"),
    ("train", lambda w: T(w) + ["ckpt_path=last", "optim.warmup_ratio=0.5"], "optim.warmup_ratio"),
    ("train", lambda w: T(w) + ["ckpt_path=last", "target.tap_layers=[0,1,3]"], "target.tap_layers"),
    ("train", lambda w: T(w) + ["ckpt_path=last", f"data.source={w['bad'] / 'other_chats.jsonl'}"], "data.source"),
    ("train", lambda w: T(w) + ["ckpt_path=last", "seed=3"], "seed"),
    # -- python -m train: damaged training data ---------------------------------------------------------------
    ("train", lambda w: T(w) + [f"data.source={w['bad'] / 'chats_latin1.jsonl'}"], "UTF-8"),
    ("train", lambda w: T(w) + [f"data.source={w['bad'] / 'empty.jsonl'}"], "empty.jsonl"),
    # -- python -m train.export -----------------------------------------------------------------------------
    ("train.export", lambda w: [f"src={w['e3']}", f"out={w['user']}"], "not an export of ours"),
    ("train.export", lambda w: [f"src={w['e3']}", f"out={w['md']}"], "not an export of ours"),
    ("train.export", lambda w: [f"src={w['e3']}", f"out={w['e3']}"], "out="),
    ("train.export", lambda w: [f"src={w['e3']}", f"out={w['user'] / 'thesis.tex'}"], "not a directory"),
    ("train.export", lambda w: [f"src={w['bad'] / 'draft_truncated'}", f"out={w['root'] / 'x1'}"], "model.safetensors"),
    ("train.export", lambda w: [f"src={w['bad'] / 'draft_random'}", f"out={w['root'] / 'x2'}"], "model.safetensors"),
    ("train.export", lambda w: [f"src={w['bad'] / 'draft_header'}", f"out={w['root'] / 'x3'}"], "model.safetensors"),
    ("train.export", lambda w: [f"src={w['bad'] / 'draft_badjson'}", f"out={w['root'] / 'x4'}"], "malformed JSON"),
    ("train.export", lambda w: [f"src={w['bad'] / 'draft_noweights'}", f"out={w['root'] / 'x5'}"], "model.safetensors"),
    ("train.export", lambda w: [f"src={w['e3']}", "format=nope", f"out={w['root'] / 'x6'}"], "format"),
    ("train.export", lambda w: [f"src={w['e3']}", "dtype=int8", f"out={w['root'] / 'x7'}"], "dtype"),
    ("train.export", lambda w: [f"src={w['root'] / 'nothing'}"], "src="),
    ("train.export", lambda w: [], "src"),
    ("train.export", lambda w: [f"src={w['e3']}", "no_such=1"], "no_such"),
    # -- python -m train.ship -------------------------------------------------------------------------------
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['e3']}"], "source"),
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['user']}"], "overwrite=true"),
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['root'] / 's1'}", f"evaluation={w['bad'] / 'results_garbage.json'}"],
     "results_garbage.json"),
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['root'] / 's2'}", f"evaluation={w['bad'] / 'results_empty.json'}"],
     "evaluation="),
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['root'] / 's3'}", f"evaluation={w['bad']}"], "evaluation="),
    ("train.ship", lambda w: [f"src={w['e3']}", f"out={w['root'] / 's4'}", f"evaluation={w['bad'] / 'random.ckpt'}"],
     "evaluation="),
    # -- python -m eval.datastore -----------------------------------------------------------------------------
    ("eval.datastore", lambda w: [f"target.name_or_path={w['target']}", f"sources=[{w['chats']}]", f"out={w['e3']}"],
     "overwrite=true"),
    # -- python -m eval: decoding settings, the output folder ------------------------------------------------------
    ("eval", lambda w: E(w, "temperatures=[nan]"), "temperatures"),
    ("eval", lambda w: E(w, "temperatures=[]"), "temperatures"),
    ("eval", lambda w: E(w, "temperatures=[-1]"), "temperatures"),
    ("eval", lambda w: E(w, "limit=0"), "limit"),
    ("eval", lambda w: E(w, "limit=-1"), "limit"),
    ("eval", lambda w: E(w, "k=abc"), "k=abc"),
    ("eval", lambda w: E(w, "k=0"), "k=0"),
    ("eval", lambda w: E(w, "seed=-1"), "seed"),
    ("eval", lambda w: E(w, "top_p=0"), "top_p"),
    ("eval", lambda w: E(w, "out_dir=/sys/draftsmith-guard/out"), "cannot write"),
    ("eval", lambda w: E(w, f"out_dir={w['user']}"), "overwrite=true"),
    # -- python -m eval.compare / eval.curve: checked before any training -------------------------------------------
    ("eval.compare", lambda w: [f"target.name_or_path={w['target']}", "limit=0"], "limit"),
    ("eval.compare", lambda w: [f"target.name_or_path={w['target']}", "temperatures=[nan]"], "temperatures"),
    ("eval.compare", lambda w: [f"target.name_or_path={w['target']}", f"run_dir={w['user']}"], "overwrite=true"),
    ("eval.curve", lambda w: [f"target.name_or_path={w['target']}", "k=abc"], "k=abc"),
    ("eval.curve", lambda w: [f"target.name_or_path={w['target']}", "limit=-1"], "limit"),
    # -- python -m eval -------------------------------------------------------------------------------------
    ("eval", lambda w: E(w, "+drafters.e3._target_=eval.decoding.drafters.load_head", f"+drafters.e3.path={w['bad'] / 'draft_truncated'}"),
     "model.safetensors"),
    ("eval", lambda w: E(w, "+drafters.e3._target_=eval.decoding.drafters.load_head", f"+drafters.e3.path={w['bad'] / 'draft_random'}"),
     "model.safetensors"),
    ("eval", lambda w: E(w), "blank prompt"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad'] / 'blank_turn.jsonl'}"), "blank user turn"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad'] / 'latin1.jsonl'}"), "UTF-8"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad'] / 'notjson.jsonl'}"), "malformed JSON"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad'] / 'empty.jsonl'}"), "no prompts"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad'] / 'wrongshape.jsonl'}"), "expected"),
    ("eval", lambda w: E(w, f"eval_set.jsonl.path={w['bad']}"), "directory"),
    ("eval", lambda w: E(w, "max_prompt_tokens=-5"), "max_prompt_tokens"),
    ("eval", lambda w: E(w, "max_new_tokens=100000"), "context"),
    ("eval", lambda w: E(w, "no_such=1"), "no_such"),
    # -- python -m data.prepare -----------------------------------------------------------------------------
    ("data.prepare", lambda w: P(w, f"data.source={w['bad'] / 'chats_latin1.jsonl'}"), "UTF-8"),
    ("data.prepare", lambda w: P(w, f"data.source={w['bad'] / 'chats_cut.json'}"), "chats_cut.json"),
    ("data.prepare", lambda w: P(w, "data.truncation=middle"), "truncation"),
    ("data.prepare", lambda w: P(w, "no_such=1"), "no_such"),
    # -- python -m data.features ----------------------------------------------------------------------------
    ("data.features", lambda w: T(w) + ["data.batch_size=0"], "batch_size"),
    ("data.features", lambda w: T(w) + ["no_such=1"], "no_such"),
    # -- python -m eval.planner -----------------------------------------------------------------------------
    ("eval.planner", lambda w: [f"acceptance={w['bad'] / 'results_garbage.json'}"], "results_garbage.json"),
    ("eval.planner", lambda w: [f"acceptance={w['bad'] / 'results_empty.json'}"], "results_empty.json"),
    ("eval.planner", lambda w: [f"acceptance={w['bad']}"], "acceptance="),
    ("eval.planner", lambda w: ["no_such=1"], "no_such"),
]


@pytest.mark.parametrize("module,args,expect", CASES, ids=[f"{i:02d}-{c[0]}-{c[2][:20]}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_changes_nothing(world, module, args, expect, tmp_path, capsys):
    before = snapshot(world["root"], tmp_path)
    code, err = invoke(module, args(world), tmp_path, capsys)
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    assert "Traceback" not in err
    assert expect.lower() in errors[0].lower(), errors[0]
    after = snapshot(world["root"], tmp_path)
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, changed[:5]


def test_battery_size():
    """The issue's closing note counts the battery; keep it honest."""
    assert len(CASES) >= 50
    assert {m for m, _, _ in CASES} >= {"train", "train.export", "train.ship", "eval", "eval.datastore", "eval.compare",
                                        "eval.curve", "data.prepare", "data.features", "eval.planner"}


def test_over_long_prompt_is_truncated_and_counted(world, tmp_path, capsys):
    """A prompt far beyond the tiny target's 256 positions: truncated from the left, counted in results.json."""
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "The sea is wide and deep and blue. " * 200}) + "\n"
                    + json.dumps({"prompt": "Hello!"}) + "\n")
    out = tmp_path / "eval-out"
    code, err = invoke("eval", E(world, f"eval_set.jsonl.path={long}", f"out_dir={out}", "k=2"), tmp_path, capsys)
    assert code == 0, err[-2000:]
    protocol = json.loads((out / "results.json").read_text())["protocol"]
    assert protocol["max_prompt_tokens"] == 256 - 4 - 2 - 1 and protocol["truncated_prompts"] == {"long": 1}
