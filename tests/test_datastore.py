"""Retrieval drafting (eval/datastore.py): the index finds every occurrence, the trie ranks continuations by count,
the current text comes first, decoding stays lossless, and the builder and reader name bad input in one line."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from data.errors import UserError
from eval.datastore import build_tokens, write_datastore
from eval.decoding.datastore import DatastoreDrafter, NGramIndex, read_datastore, trie_proposal
from eval.decoding.decoder import SpeculativeDecoder
from models.heads.drafting import Sampler
from models.heads.trees import TreeSpec
from models.target import FrozenTarget
from test_decoder import plain_greedy

SEP = -1


def test_index_finds_every_occurrence_and_cuts_at_the_answer_end():
    toks = torch.tensor([1, 2, 3, 8, SEP, 1, 2, 4, SEP, 5, 1, 2, 3, 9, SEP, 7, 1, 2])
    idx = NGramIndex(toks, 1, 3)
    starts = idx.starts([1, 2], limit=10)
    assert starts.tolist() == [2, 7, 12]  # the 1, 2 at the very end has nothing after it
    assert idx.continuations(starts, 3) == [[3, 8], [4], [3, 9]]
    assert idx.starts([1, 2], limit=2).tolist() == [7, 12]  # the last `limit` occurrences
    assert idx.starts([2, 3], limit=10).tolist() == [3, 13]
    assert idx.starts([6, 6], limit=10).numel() == 0 and idx.starts([1, 2, 3, 4], limit=10).numel() == 0
    assert idx.starts([8], limit=10).numel() == 0  # 8 ends an answer: no continuation
    # a hash collision never yields a match: the stored n-gram is compared
    from eval.decoding.datastore import _hash

    idx.keys[2][:] = _hash(torch.tensor([2, 3]))  # every 2-gram collides with [2, 3]
    assert idx.starts([2, 3], limit=100).tolist() == [3, 13]


def test_trie_keeps_the_most_frequent_nodes():
    rows = [[3, 7, 1], [3, 7, 2], [3, 7], [4, 5], [3, 6]]
    chain = trie_proposal(rows, budget=3, depth=3, topk=1)
    assert chain.tokens.tolist() == [3, 7, 1] and chain.parents.tolist() == [-1, 0, 1]
    tree = trie_proposal(rows, budget=4, depth=2, topk=2)
    # counts: (3) 4, (3,7) 3, (4) 1, (3,6) 1, (4,5) 1 → the four highest, shallower first on ties
    assert tree.tokens.tolist() == [3, 4, 7, 6] and tree.parents.tolist() == [-1, -1, 0, 0]
    assert trie_proposal(rows, budget=8, depth=3, topk=2, min_share=0.5).tokens.tolist() == [3, 7]
    assert trie_proposal(rows, budget=8, depth=1, topk=8).tokens.tolist() == [3, 4]


@pytest.fixture()
def store(tmp_path):
    toks = torch.tensor([10, 11, 12, 13, SEP, 10, 11, 12, 14, SEP, 10, 11, 12, 13, SEP, 20, 21, 22, SEP], dtype=torch.int32)
    write_datastore(tmp_path / "ds", toks, {"target": {"name_or_path": "tiny"}})
    return tmp_path / "ds"


def test_drafter_longest_suffix_first_and_the_current_text_at_equal_length(store):
    d = DatastoreDrafter(str(store), max_ngram=3, min_ngram=1)
    d.start(torch.tensor([5, 10]), None)
    assert d.propose(11, 3, Sampler()).tokens.tolist() == [12, 13]  # the datastore's majority after 10 11
    tree = d.propose_tree(11, TreeSpec(budget=4, depth=3, topk=2), Sampler())
    assert tree.tokens.tolist() == [12, 13, 14] and tree.parents.tolist() == [-1, 0, 0]
    d.start(torch.tensor([11, 99, 7, 10]), None)  # the current text has "10 11"? no; "11" → 99 at n=1
    assert d.propose(11, 3, Sampler()).tokens.tolist() == [12, 13]  # n=2 in the datastore beats n=1 in the text
    d.start(torch.tensor([10, 11, 50, 51, 10]), None)
    assert d.propose(11, 3, Sampler()).tokens.tolist() == [50, 51, 10]  # equal n: the current text first
    assert d.propose_tree(11, TreeSpec(8, 3, 4), Sampler()).parents.tolist() == [-1, 0, 1]  # its one branch
    d.start(torch.tensor([30, 31]), None)
    assert d.propose(32, 3, Sampler()).tokens.numel() == 0
    assert d.propose_tree(32, TreeSpec(), Sampler()).tokens.numel() == 0


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(model=tiny_model("llama", layers=4), tap_layers=[1, 2, 3])


def test_decoding_with_a_datastore_is_lossless(target, tmp_path):
    """A datastore of the target's own continuations (and noise): greedy output equals plain decoding as a chain
    and as a tree, and sampling runs with its deterministic chains."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (6, 9)]
    rows = []
    for p in prompts:
        ref = plain_greedy(target.model, p, 24)
        rows += [p.tolist()[-3:] + ref[:12], [SEP], ref[5:20], [SEP], torch.randint(0, 128, (30,), generator=g).tolist(), [SEP]]
    write_datastore(tmp_path / "ds", torch.tensor(sum(rows, []), dtype=torch.int32), {"target": {}})
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    for p in prompts:
        ref = plain_greedy(target.model, p, 24)
        d = DatastoreDrafter(str(tmp_path / "ds"), target=target)
        out, st = dec.generate(p, d, k=4, max_new_tokens=24)
        assert out == ref and st.verified_tokens / st.passes > 1.5  # it drafts the target's own text
        out, _ = dec.generate(p, d, k=4, max_new_tokens=24, tree=TreeSpec(budget=8, depth=4, topk=2))
        assert out == ref
        sampled, _ = dec.generate(p, d, k=4, max_new_tokens=12, sampler=Sampler(temperature=1.0, generator=g))
        assert len(sampled) == 12


def test_builder_reads_answers_and_bad_input_is_one_line(tiny_target_dir, tiny_chats, tmp_path, store):
    from transformers import AutoTokenizer

    from data.chat import tokenize_conversation
    from data.conversations import load_conversations

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokens, counts = build_tokens(tok, [str(tiny_chats)], heldout_fraction=0.2)
    convs = load_conversations(str(tiny_chats), "train", 0.2, verbose=False)  # the held-out split is left out
    assert 0 < len(convs) < len(load_conversations(str(tiny_chats), "all", 0.2, verbose=False))
    enc = tokenize_conversation(tok, convs[0]["messages"])
    first = [t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m]
    n_first = sum(1 for a, b in zip([0] + enc["loss_mask"], enc["loss_mask"]) if b and not a)
    got = tokens.tolist()
    assert [t for t in got[: len(first) + n_first] if t >= 0] == first  # answers in order, −1 after each
    assert counts["conversations"] == len(convs) and counts["answers"] == got.count(-1)
    assert counts["answer_tokens"] == len(got) - got.count(-1)
    with pytest.raises(UserError, match="not a datastore"):
        DatastoreDrafter(str(tmp_path))
    small = FrozenTarget(model=tiny_model("llama", vocab_size=16, layers=1), tap_layers=[0])
    with pytest.raises(UserError, match="beyond this target's vocabulary of 16"):
        DatastoreDrafter(str(store), target=small)
    with pytest.raises(UserError, match="min_ngram"):
        DatastoreDrafter(str(store), min_ngram=3, max_ngram=2)
    assert read_datastore(store)[0].dtype == torch.long


def test_cli_builds_a_datastore_and_names_a_missing_source(tiny_target_dir, tiny_chats, tmp_path):
    from test_cli_errors import run

    r = run("eval.datastore", f"target.name_or_path={tiny_target_dir}", f"sources=[{tiny_chats}]", f"out={tmp_path / 'ds'}")
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, info = read_datastore(tmp_path / "ds")
    assert info["answers"] == int((tokens == -1).sum()) > 0 and info["sources"] == [str(tiny_chats)]
    r = run("eval.datastore", f"target.name_or_path={tiny_target_dir}", f"sources=[{tmp_path / 'none.jsonl'}]",
            f"out={tmp_path / 'ds2'}")
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(err) == 1 and "none.jsonl" in err[0] and not (tmp_path / "ds2").exists()


def test_a_drafter_config_with_an_unknown_key_is_one_line():
    """A removed or misspelt argument of a drafter's factory names the entry and the key, before anything loads."""
    from eval.decoding.drafters import build_drafter

    node = {"_target_": "eval.decoding.drafters.load_head_with_lookup", "path": "assets/embedded-eagle", "datastore": "x"}
    with pytest.raises(UserError, match="drafters.floor .*datastore"):
        build_drafter(node, None, name="floor")


@pytest.mark.parametrize("name,vocab", [("smollm2", 49152), ("embedded", 8192)])
def test_the_shipped_datastores_read_and_fit_their_targets(name, vocab):
    from conftest import ROOT

    tokens, info = read_datastore(ROOT / "assets" / f"{name}-datastore")
    assert info["target"]["name_or_path"] == name and info["answers"] == int((tokens == -1).sum())
    assert int(tokens.max()) < info["target"]["tokenizer_size"] == vocab
    assert info["answer_tokens"] == int((tokens >= 0).sum())
