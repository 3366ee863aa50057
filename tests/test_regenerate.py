"""Regeneration: assistant turns replaced by the target's answers, shards written atomically, resume skips done ids."""
from __future__ import annotations

import json

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
