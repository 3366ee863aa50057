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
