"""Chat template + loss mask on three templates (embedded ChatML, Llama-3-style, Qwen-style), truncation, label shift."""
from __future__ import annotations

import pytest
import torch

from data.chat import render_segments, shift_labels, tokenize_conversation
from data.errors import UserError

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "Thanks a lot!"},
        {"role": "assistant", "content": "Sure, here is a short answer."}]
END_OF_TURN = {"embedded": "<|im_end|>", "llama3": "<|eot_id|>", "qwen": "<|im_end|>"}


def runs(mask):
    """Contiguous runs of 1s as (start, end) index pairs."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_mask_is_exactly_the_assistant_turns(chat_tokenizer):
    kind, tok = chat_tokenizer
    enc = tokenize_conversation(tok, CHAT)
    ids, mask = enc["input_ids"], enc["loss_mask"]
    # the tokens are the render, and the mask covers each answer plus its end-of-turn token, nothing else
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    answers = [tok.decode(ids[a:b]) for a, b in runs(mask)]
    assert answers == [m["content"] + END_OF_TURN[kind] for m in CHAT if m["role"] == "assistant"]
    # the prompt before each answer is tokenised exactly as at inference (add_generation_prompt)
    first_answer = runs(mask)[0][0]
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert ids[:first_answer] == tok(prompt, add_special_tokens=False)["input_ids"]


def test_segments_concatenate_to_the_render(chat_tokenizer):
    _, tok = chat_tokenizer
    segs = render_segments(tok, CHAT)
    assert "".join(t for t, _ in segs) == tok.apply_chat_template(CHAT, tokenize=False)
    assert [a for _, a in segs].count(True) == 2


def test_shift_labels_convention():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    labels, w = shift_labels(ids, mask)
    # position t predicts token t+1 and is weighted by loss_mask[t+1]
    assert w.tolist() == [[0, 1, 1, 0, 0]]
    assert labels.tolist() == [[-100, 7, 8, -100, -100]]


def test_truncation_policies(chat_tokenizer):
    _, tok = chat_tokenizer
    full = tokenize_conversation(tok, CHAT)
    first_turn_end = runs(full["loss_mask"])[0][1]
    n = runs(full["loss_mask"])[-1][1] - 1  # one token short of the last answer's end
    turn = tokenize_conversation(tok, CHAT, max_length=n, truncation="turn")
    assert len(turn["input_ids"]) == first_turn_end and turn["loss_mask"][-1] == 1  # cut at a turn boundary
    hard = tokenize_conversation(tok, CHAT, max_length=n, truncation="hard")
    assert hard["input_ids"] == full["input_ids"][:n]
    assert tokenize_conversation(tok, CHAT, max_length=n, truncation="drop") is None
    tiny = tokenize_conversation(tok, CHAT, max_length=first_turn_end - 2, truncation="turn")  # not even one answer fits
    assert len(tiny["input_ids"]) == first_turn_end - 2
    with pytest.raises(UserError, match="truncation"):
        tokenize_conversation(tok, CHAT, max_length=n, truncation="middle")


def test_tokenizer_without_chat_template():
    from conftest import make_tokenizer

    tok = make_tokenizer("qwen")
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        tokenize_conversation(tok, CHAT)
