"""Conversation loading: streaming parse of cut-off JSON, JSONL, normalisation, dedup, split, bad input."""
from __future__ import annotations

import json

import pytest

from data.conversations import id_bucket, load_conversations, read_conversations
from data.errors import UserError


def rec(i, turns, key="conversations"):
    if key == "conversations":
        return {"id": i, "conversations": [{"from": r, "value": v} for r, v in turns]}
    return {"id": i, "messages": [{"role": r, "content": v} for r, v in turns]}


GOOD = [rec("a_0", [("human", "hi"), ("gpt", "hello")]), rec("b_0", [("user", "q"), ("chatgpt", "a"), ("human", "q2"), ("bard", "a2")])]


def test_truncated_json_array_keeps_complete_records(tmp_path):
    text = json.dumps(GOOD + [rec("c_0", [("human", "x"), ("gpt", "y")])], indent=2)
    cut = text[: text.rindex('"y"') + 2]  # cut mid-record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    convs, report = read_conversations(str(p))
    assert [c["id"] for c in convs] == ["a_0", "b_0"]
    assert any("cut off" in n for n in report.notes)


def test_roles_normalised_empty_turns_dropped_merged(tmp_path):
    p = tmp_path / "c.jsonl"
    lines = [rec("x", [("system", "be nice"), ("human", "hi"), ("human", ""), ("human", "again"), ("bing", "ok")]),
             rec("y", [("gpt", "leading answer"), ("human", "q"), ("assistant", "a")], key="messages")]
    p.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    convs, _ = read_conversations(str(p))
    assert convs[0]["messages"] == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi\n\nagain"},
                                    {"role": "assistant", "content": "ok"}]
    assert [m["role"] for m in convs[1]["messages"]] == ["user", "assistant"]


def test_drops_are_counted_by_reason(tmp_path):
    p = tmp_path / "c.jsonl"
    lines = [json.dumps(GOOD[0]), json.dumps(GOOD[0]), "{not json", json.dumps(rec("u", [("human", "q"), ("robot", "a")])),
             json.dumps(rec("n", [("human", "only a question")])), json.dumps({"id": "z"})]
    p.write_text("\n".join(lines) + "\n")
    convs, report = read_conversations(str(p))
    assert len(convs) == 1
    assert report.dropped == {"duplicate_id": 1, "malformed_json": 1, "unknown_role": 1, "no_assistant_turn": 1,
                              "no_conversations_field": 1}
    assert "kept 1" in report.summary()


@pytest.mark.parametrize("content,match", [("", "empty"), ("   \n", "empty"), ('{"a": 1}', "JSON array")])
def test_bad_files(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(UserError, match=match):
        read_conversations(str(p))


def test_missing_file():
    with pytest.raises(UserError, match="no such file"):
        read_conversations("/nonexistent/convs.json")


def test_nothing_usable_is_an_error(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(rec("n", [("human", "q")])) + "\n")
    with pytest.raises(UserError, match="no usable conversation"):
        load_conversations(str(p), "all", cache_dir=tmp_path / "cache", verbose=False)


def test_split_is_deterministic_disjoint_and_keeps_parts_together(tmp_path):
    recs = [rec(f"id{i}_{k}", [("human", "q"), ("gpt", "a")]) for i in range(200) for k in range(2)]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    tr = load_conversations(str(p), "train", 0.2, cache_dir=tmp_path / "cache", verbose=False)
    ho = load_conversations(str(p), "heldout", 0.2, cache_dir=tmp_path / "cache", verbose=False)
    assert len(tr) + len(ho) == 400 and 40 <= len(ho) <= 130
    assert not set(tr["id"]) & set(ho["id"])
    assert {i.split("_")[0] for i in tr["id"]}.isdisjoint({i.split("_")[0] for i in ho["id"]})
    assert id_bucket("abc_1") == id_bucket("abc_7") != id_bucket("abd_1")
    again = load_conversations(str(p), "heldout", 0.2, cache_dir=tmp_path / "cache", verbose=False)
    assert again["id"] == ho["id"]


def test_packaged_sharegpt_is_parsed_as_a_stream():
    convs, report = read_conversations("sharegpt")
    complete = report.kept + sum(report.dropped.values())
    assert 17_500 <= complete <= 17_800, report.summary()  # every complete record of the cut-off file
    assert report.kept > 17_000
    assert any("cut off" in n for n in report.notes)
    assert all(c["messages"][0]["role"] in ("user", "system") for c in convs[:500])


def _answers(tmp_path, name, n, word, extra=()):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(rec(f"id{i}_0", [("human", f"q{i}"), ("gpt", f"{word}{i}")]))
                           for i in [*range(n), *extra]))
    return str(p)


def test_a_list_of_sources_keeps_both_answers_to_a_prompt_on_one_side_of_the_split(tmp_path):
    greedy = _answers(tmp_path, "greedy.jsonl", 100, "g")
    sampled = _answers(tmp_path, "sampled.jsonl", 60, "s", extra=[500])
    convs, report = read_conversations([greedy, sampled])
    assert report.kept == len(convs) == 161
    assert [c["id"] for c in convs[:4]] == ["id0_0", "id0_0@1", "id1_0", "id1_0@1"]  # interleaved, later ids renamed
    assert convs[1]["messages"][1]["content"] == "s0" and convs[0]["messages"][1]["content"] == "g0"
    assert "id500_0" in [c["id"] for c in convs]  # an id no earlier source holds keeps its name
    assert all(c["bucket"] == id_bucket(c["id"].split("@")[0]) for c in convs)
    assert any("60 ids already in an earlier source" in n for n in report.notes), report.summary()
    tr = load_conversations([greedy, sampled], "train", 0.3, cache_dir=tmp_path / "cache", verbose=False)
    ho = load_conversations([greedy, sampled], "heldout", 0.3, cache_dir=tmp_path / "cache", verbose=False)
    assert len(tr) + len(ho) == 161 and len(ho) > 0
    base = lambda ids: {i.split("@")[0] for i in ids}  # noqa: E731
    assert base(tr["id"]).isdisjoint(base(ho["id"]))
    assert any(i.endswith("@1") for i in ho["id"]) and any("@" not in i for i in ho["id"])
    # a list of one is that source, and the cache tells a list from its first entry
    assert load_conversations([greedy], "all", cache_dir=tmp_path / "cache", verbose=False)["id"] == \
        load_conversations(greedy, "all", cache_dir=tmp_path / "cache", verbose=False)["id"]


def test_a_bad_entry_in_a_list_of_sources_is_one_line_naming_it(tmp_path):
    good = _answers(tmp_path, "g.jsonl", 5, "g")
    with pytest.raises(UserError, match="missing.jsonl: no such file"):
        read_conversations([good, str(tmp_path / "missing.jsonl")])
    with pytest.raises(UserError, match=r"data.source=\[\]"):
        load_conversations([], "all", cache_dir=tmp_path / "cache", verbose=False)


def test_jsonl_lines_end_at_newline_only(tmp_path):
    # U+2028/U+2029 are valid unescaped inside a JSON string (ensure_ascii=False writes them raw); \r\n files still read
    text = "line one\u2028line two\u2029end"
    p = tmp_path / "seps.jsonl"
    p.write_text(json.dumps(rec("s_0", [("human", text), ("gpt", "ok")]), ensure_ascii=False) + "\r\n"
                 + json.dumps(rec("t_0", [("human", "q"), ("gpt", "a\u2028b")]), ensure_ascii=False) + "\n", encoding="utf-8")
    assert "\u2028" in p.read_text(encoding="utf-8") and len(p.read_text(encoding="utf-8").splitlines()) > 2
    convs, report = read_conversations(str(p))
    assert [c["id"] for c in convs] == ["s_0", "t_0"] and sum(report.dropped.values()) == 0
    assert convs[0]["messages"][0]["content"] == text and convs[1]["messages"][1]["content"] == "a\u2028b"


def test_content_as_a_list_of_parts_is_its_text(tmp_path):
    parts = {"id": "p_0", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "this."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    p = tmp_path / "parts.jsonl"
    p.write_text(json.dumps(parts) + "\n")
    convs, report = read_conversations(str(p))
    assert convs[0]["messages"] == [{"role": "user", "content": "Describe this."}, {"role": "assistant", "content": "A cat."}]
    assert "1 non-text message parts (images, audio) left out" in report.summary()


def test_a_dataset_folder_is_read_at_any_split_name(tmp_path):
    folder = tmp_path / "ds"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train_sft.jsonl").write_text("\n".join(json.dumps(r) for r in GOOD) + "\n")
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                      "  - split: train_sft\n    path: data/train_sft.jsonl\n---\n")
    convs, _ = read_conversations(str(folder), hub_split="train_sft")
    assert [c["id"] for c in convs] == ["a_0", "b_0"]
    with pytest.raises(UserError, match="no split 'train'.*data.hub_split"):
        read_conversations(str(folder))
    ds = load_conversations(str(folder), "all", cache_dir=tmp_path / "cache", verbose=False, hub_split="train_sft")
    assert sorted(ds["id"]) == ["a_0", "b_0"]


def test_prompt_file_with_line_separators_and_parts(tmp_path):
    from eval.sets import JsonlSet

    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "first\u2028second"}, ensure_ascii=False) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                         {"type": "text", "text": "there"}]}]}) + "\n",
                 encoding="utf-8")
    convs = JsonlSet(str(p)).conversations()
    assert [c["turns"] for c in convs] == [["first\u2028second"], ["Hi there"]]
