"""Regeneration: assistant turns replaced by the target's answers, shards written atomically, resume skips done ids."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tokenizer, tiny_model
from data.regenerate import finished_ids, regenerate_conversations


def test_regenerate_replaces_answers_batched():
    tok = make_tokenizer("embedded")
    model = tiny_model("llama", vocab_size=len(tok))
    convs = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "OLD"},
                                      {"role": "user", "content": "more"}, {"role": "assistant", "content": "OLD"}]},
             {"id": "b", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "OLD"}]}]
    torch.manual_seed(0)
    out = regenerate_conversations(model, tok, convs, max_new_tokens=5, temperature=0.0, top_p=1.0, batch_size=2)
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in out[1]["messages"]] == ["system", "user", "assistant"]
    assert all(m["content"] != "OLD" for c in out for m in c["messages"])
    # greedy answers do not depend on the batch they are in
    alone = regenerate_conversations(model, tok, convs[1:], max_new_tokens=5, temperature=0.0, top_p=1.0, batch_size=1)
    assert alone[0]["messages"] == out[1]["messages"]
    first_only = regenerate_conversations(model, tok, convs[:1], 5, 0.0, 1.0, 2, max_turns=1)
    assert [m["role"] for m in first_only[0]["messages"]] == ["user", "assistant"]


def test_finished_ids(tmp_path):
    (tmp_path / "shard-00000.jsonl").write_text(json.dumps({"id": "x", "messages": []}) + "\n")
    (tmp_path / ".shard-00001.jsonl.tmp-123").write_text("partial")
    assert finished_ids(tmp_path) == {"x"}


def test_make_source_writes_the_missing_file_and_resumes(tmp_path, capsys):
    from conftest import write_tiny_chats, write_tiny_target
    from data.regenerate import make_source

    target = write_tiny_target(tmp_path / "target")
    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=6)
    out = tmp_path / "made" / "answers.jsonl"
    settings = {"target": {"name_or_path": str(target)}, "data": {"source": str(chats)}, "max_new_tokens": 3,
                "max_turns": 1, "batch_size": 2, "shard_size": 2, "temperature": 0}
    make_source(out, settings)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 4 and len(list((tmp_path / "made" / "answers").glob("shard-*.jsonl"))) == (len(rows) + 1) // 2
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    assert "missing; making it: python -m data.regenerate" in capsys.readouterr().out
    out.unlink()  # shards kept: a rerun answers nothing again and joins the same file
    make_source(out, settings)
    assert "0 to do" in capsys.readouterr().out
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_datamodule_makes_its_missing_source_only_when_told_how(tmp_path):
    import pytest
    from hydra import initialize_config_dir

    from conftest import ROOT, write_tiny_chats, write_tiny_target
    from data.datamodule import DraftDataModule
    from data.errors import UserError

    target = write_tiny_target(tmp_path / "target")
    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=6)
    missing = tmp_path / "regen" / "answers.jsonl"
    kw = dict(source=str(missing), tokenizer=str(target), heldout_fraction=0.3, max_length=64)
    with pytest.raises(UserError, match="answers.jsonl: no such file"):
        DraftDataModule(**kw).split("train")
    assert not missing.exists()
    make = {"file": str(missing), "target": {"name_or_path": str(target)}, "data": {"source": str(chats)},
            "max_new_tokens": 3, "max_turns": 1}
    typo = dict(kw, source=str(tmp_path / "regen" / "answer.jsonl"))  # a source make does not stand for: no regeneration
    with pytest.raises(UserError, match="answer.jsonl: no such file"):
        DraftDataModule(**typo, make=make).split("train")
    assert not missing.exists()
    dm = DraftDataModule(**kw, make=make)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):  # inside a Hydra app, as python -m train runs it
        n = len(dm.split("train")) + len(dm.split("heldout"))
    assert n == len(missing.read_text().splitlines()) >= 4


def compose_regen(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("regenerate", overrides=overrides)


def regen_overrides(target, chats, out, *extra: str) -> list[str]:
    return [f"target.name_or_path={target}", f"data.source={chats}", f"out_dir={out}", "data.heldout_fraction=0.0",
            "max_new_tokens=3", "max_turns=1", "batch_size=4", "shard_size=2", *extra]


def read_shards(out) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.glob("shard-*.jsonl"))}


def test_rerun_after_a_deleted_shard_never_writes_over_another(tmp_path, tiny_target_dir):
    import pytest

    from conftest import write_tiny_chats
    from data.errors import UserError
    from data.regenerate import guard_regen_out, run

    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=6)
    out = tmp_path / "regen"
    run(compose_regen(regen_overrides(tiny_target_dir, chats, out)))
    before = read_shards(out)
    assert len(before) == 3 and json.loads((out / "regenerate.json").read_text())["temperature"] == 0.0
    assert guard_regen_out(compose_regen(regen_overrides(tiny_target_dir, chats, out))) == out  # the CLI resumes here
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"out_dir=.*regen: exists and is not regenerated shards of ours"):
        guard_regen_out(compose_regen(regen_overrides(tiny_target_dir, chats, out)))
    (out / "notes.txt").unlink()
    middle = sorted(before)[1]
    (out / middle).unlink()
    run(compose_regen(regen_overrides(tiny_target_dir, chats, out)))
    after = read_shards(out)
    assert {k: v for k, v in after.items() if k in before} == before  # the others untouched, the deleted one made again
    ids = [json.loads(line)["id"] for text in after.values() for line in text.splitlines()]
    assert len(ids) == len(set(ids)) == 6
    # other settings into the same set: refused in one line naming what differs
    with pytest.raises(UserError, match=r"other settings \(temperature: 0.0 there, 1.0 now\); choose another out_dir"):
        run(compose_regen(regen_overrides(tiny_target_dir, chats, out, "temperature=1")))
    other = tmp_path / "other.jsonl"
    other.write_text(chats.read_text())
    with pytest.raises(UserError, match=r"prompts: .*choose another out_dir"):
        run(compose_regen(regen_overrides(tiny_target_dir, other, out)))


def test_a_cut_off_shard_is_one_error_naming_file_and_line(tmp_path):
    import pytest

    from data.errors import UserError

    (tmp_path / "shard-00000000.jsonl").write_text(json.dumps({"id": "x", "messages": []}) + "\n" + '{"id": "y", "mess')
    with pytest.raises(UserError, match=r"shard-00000000.jsonl:2: malformed shard line .*delete it"):
        finished_ids(tmp_path)


def test_unreachable_endpoint_is_one_error_line(tmp_path):
    import subprocess

    from eval.bench_regen import free_port
    import sys

    from conftest import ROOT, write_tiny_chats

    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=2)
    cmd = [sys.executable, "-m", "data.regenerate", f"endpoint=http://127.0.0.1:{free_port()}/v1", "model=m",
           f"data.source={chats}", f"out_dir={tmp_path / 'out'}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: endpoint http://127.0.0.1:") and "unreachable" in lines[-1]
    assert "Traceback" not in r.stderr


@pytest.fixture
def served_target(tmp_path_factory):
    """``transformers serve`` on loopback with the tiny target (a local folder), stopped at the end."""
    from conftest import write_tiny_target
    from eval.bench_regen import start_server, stop_server

    target = write_tiny_target(tmp_path_factory.mktemp("served") / "target")
    proc, api = start_server(str(target), "float32", "cpu", [], target.parent / "serve.log", timeout_s=240)
    try:
        yield target, api
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_regenerate_through_a_real_openai_compatible_server(tmp_path, served_target, capsys):
    from conftest import write_tiny_chats
    from data.errors import UserError
    from data.regenerate import run

    target, endpoint = served_target
    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=3)
    out = tmp_path / "regen"
    over = [f"endpoint={endpoint}", "concurrency=2", "max_turns=null", "temperature=0.7", "top_p=0.9",
            "chat_template_kwargs={enable_thinking:false}"]
    run(compose_regen(regen_overrides(target, chats, out, *over)))
    rows = [json.loads(line) for text in read_shards(out).values() for line in text.splitlines()]
    source = {json.loads(line)["id"]: json.loads(line) for line in chats.read_text().splitlines()}
    assert sorted(r["id"] for r in rows) == sorted(source)
    for r in rows:  # every user turn kept, each followed by the served model's answer
        assert set(r) == {"id", "messages"}
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * len(source[r["id"]]["conversations"][::2])
        assert [m["content"] for m in r["messages"][::2]] == [t["value"] for t in source[r["id"]]["conversations"][::2]]
        assert all(isinstance(m["content"], str) for m in r["messages"])
    recorded = json.loads((out / "regenerate.json").read_text())
    assert recorded["answers_from"] == {"endpoint": endpoint, "model": str(target)}  # the one model the server lists
    assert recorded["chat_template_kwargs"] == {"enable_thinking": False} and recorded["top_p"] == 0.9
    before = read_shards(out)
    capsys.readouterr()
    run(compose_regen(regen_overrides(target, chats, out, *over)))  # resume: nothing left to ask
    assert "3 already done, 0 to do" in capsys.readouterr().out and read_shards(out) == before
    with pytest.raises(UserError, match=r"endpoint .*/chat/completions answered HTTP 400"):
        run(compose_regen(regen_overrides(target, chats, tmp_path / "other", *over, "model=not-served")))


def test_bench_regen_writes_its_json(tmp_path, tiny_target_dir):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT, write_tiny_chats
    from eval.bench_regen import run

    chats = write_tiny_chats(tmp_path / "chats.jsonl", n=4)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("bench_regen", overrides=[f"target.name_or_path={tiny_target_dir}", "target.dtype=float32",
                                                f"data.source={chats}", "data.heldout_fraction=0.0", "conversations=3",
                                                "max_new_tokens=4", "batch_size=2", "modes=[in_process]",
                                                f"out_dir={tmp_path / 'bench'}", "device=cpu"])
    report = run(cfg)
    saved = json.loads((tmp_path / "bench" / "bench_regen.json").read_text())
    assert saved["results"] == report["results"] and saved["machine"]["cpus"] >= 1 and saved["date"]
    r = saved["results"]["in_process"]
    assert r["conversations"] == 3 and r["answer_tokens"] > 0
    # wall_s is written rounded to 0.01 s: the rate lies between those bounds
    assert 3 / (r["wall_s"] + 0.005) * 3600 - 0.1 <= r["conversations_per_hour"] <= 3 / max(r["wall_s"] - 0.005, 1e-9) * 3600 + 0.1


def test_settings_become_overrides_hydra_reads_back():
    from data.regenerate import flat, override_value

    settings = {"target": {"name_or_path": "x"}, "chat_template_kwargs": {"enable_thinking": False}, "max_turns": None}
    over = [f"{k}={override_value(v)}" for k, v in flat(settings).items()]
    assert over == ["target.name_or_path=x", "chat_template_kwargs={enable_thinking:false}", "max_turns=null"]
    cfg = compose_regen(over)
    assert cfg.chat_template_kwargs == {"enable_thinking": False} and cfg.max_turns is None


def test_answer_temperature_from_make_or_the_shards_settings(tmp_path):
    from data.regenerate import SETTINGS_FILE, answer_temperature

    assert answer_temperature({"source": "x.jsonl", "make": {"temperature": 0.7}}) == 0.7
    assert answer_temperature({"source": "sharegpt"}) is None  # the dataset's own answers
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / SETTINGS_FILE).write_text(json.dumps({"temperature": 0.0}))  # a.jsonl joined from a/
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / SETTINGS_FILE).write_text(json.dumps({"temperature": 1.0}))
    (tmp_path / "b" / "shard-00000000.jsonl").write_text("")  # a shard read as the source: its folder's settings
    assert answer_temperature({"source": str(tmp_path / "a.jsonl")}) == 0.0
    assert answer_temperature({"source": str(tmp_path / "b" / "shard-00000000.jsonl")}) == 1.0
    assert answer_temperature({"source": [str(tmp_path / "a.jsonl"), str(tmp_path / "b" / "shard-00000000.jsonl")]}) is None
    assert answer_temperature({"source": str(tmp_path / "unknown.jsonl")}) is None
