"""Chat template + loss mask on three templates (embedded ChatML, Llama-3-style, Qwen-style), truncation, label shift."""
from __future__ import annotations

from pathlib import Path

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


# Real chat templates (tests/fixtures/templates; sources in its README) on a tiny BPE with each family's special tokens.
TEMPLATES = {  # name: (file, bos, eos, special tokens, end-of-turn marker after an answer)
    "llama-3.1": ("llama-3.1-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
                  ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
              "<|im_end|>"),
    "mistral-v3": ("mistral-v3-instruct.jinja", "<s>", "</s>", ["<s>", "</s>", "[INST]", "[/INST]"], "</s>"),
    "gemma-2": ("gemma-2-it.jinja", "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "gemma-3": ("gemma-3-it.jinja", "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "r1-distill-qwen": ("deepseek-r1-distill-qwen.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                        "<｜end▁of▁sentence｜>"),
}
TEMPLATE_DIR = Path(__file__).parent / "fixtures" / "templates"
REASONED = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "<think>\nThe capital.\n</think>\n\nParis is the capital of France."},
            {"role": "user", "content": "Thanks a lot!"},
            {"role": "assistant", "content": "<think>\nBe brief.\n</think>\n\nSure, here is a short answer."}]


def real_template_tokenizer(name: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import CORPUS

    file, bos, eos, specials, _ = TEMPLATES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    fast.chat_template = (TEMPLATE_DIR / file).read_text(encoding="utf-8")
    return fast


def masked_texts(tok, enc) -> list[str]:
    return [tok.decode(enc["input_ids"][a:b]) for a, b in runs(enc["loss_mask"])]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_real_templates_mask_each_answer_and_its_end_of_turn(name):
    tok = real_template_tokenizer(name)
    eot = TEMPLATES[name][4]
    chat = CHAT[1:] if name == "gemma-2" else CHAT  # Gemma 2's template refuses a system turn
    kw = {"enable_thinking": False} if name == "qwen3" else {}  # thinking on: test_qwen3_with_and_without_thinking
    enc = tokenize_conversation(tok, chat, chat_template_kwargs=kw)
    assert tok.decode(enc["input_ids"]) == tok.apply_chat_template(chat, tokenize=False, **kw)
    got = masked_texts(tok, enc)
    # Mistral writes a space between [/INST] and the answer: a token holding it and the answer start is one the model emits
    assert [t.removeprefix(" ") if name == "mistral-v3" else t for t in got] == [m["content"] + eot for m in chat if m["role"] == "assistant"]
    # the mask starts where generation starts at inference: the tokens before the last answer are its prompt
    last = runs(enc["loss_mask"])[-1][0]
    prompt = tok.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True, **kw)
    assert enc["input_ids"][:last] == tok(prompt, add_special_tokens=False)["input_ids"]


def test_mistral_moves_the_system_prompt_and_is_still_masked():
    tok = real_template_tokenizer("mistral-v3")
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert full.index("You are a helpful assistant.") > full.index("Paris is the capital")  # not prefix-stable
    assert len(runs(tokenize_conversation(tok, CHAT)["loss_mask"])) == 2


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_with_and_without_thinking(thinking):
    tok = real_template_tokenizer("qwen3")
    kw = {"enable_thinking": thinking}
    plain = tokenize_conversation(tok, CHAT, chat_template_kwargs=kw)
    last = runs(plain["loss_mask"])[-1]
    if thinking:  # the empty think block on the last answer is not in the prompt: the model writes it
        assert tok.decode(plain["input_ids"][last[0]:last[1]]) == "<think>\n\n</think>\n\nSure, here is a short answer.<|im_end|>"
    else:  # the prompt ends with the empty think block: the answer alone is generated
        assert tok.decode(plain["input_ids"][last[0]:last[1]]) == "Sure, here is a short answer.<|im_end|>"
    prompt = tok.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True, **kw)
    assert plain["input_ids"][:last[0]] == tok(prompt, add_special_tokens=False)["input_ids"]
    # reasoning: stripped from the earlier answer, kept on the last one (masked where thinking is on: the model writes it)
    enc = tokenize_conversation(tok, REASONED, chat_template_kwargs=kw)
    last = "<think>\nBe brief.\n</think>\n\n" * thinking + "Sure, here is a short answer.<|im_end|>"
    assert masked_texts(tok, enc) == ["Paris is the capital of France.<|im_end|>", last]


def test_reasoning_distill_strips_reasoning_from_every_answer():
    tok = real_template_tokenizer("r1-distill-qwen")
    enc = tokenize_conversation(tok, REASONED)
    assert masked_texts(tok, enc) == ["\n\nParis is the capital of France.<｜end▁of▁sentence｜>",
                                      "\n\nSure, here is a short answer.<｜end▁of▁sentence｜>"]


def test_short_answer_is_not_found_in_the_question():
    tok = real_template_tokenizer("llama-3.1")
    chat = [{"role": "user", "content": "Answer yes or no: is the sea blue?"}, {"role": "assistant", "content": "no"},
            {"role": "user", "content": "no?"}, {"role": "assistant", "content": "a"}]
    assert masked_texts(tok, tokenize_conversation(tok, chat)) == ["no<|eot_id|>", "a<|eot_id|>"]


def test_generation_blocks_give_the_spans():
    tok = make_tokenizer_with_generation_blocks()
    enc = tokenize_conversation(tok, CHAT)
    assert masked_texts(tok, enc) == [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]


def make_tokenizer_with_generation_blocks():
    from conftest import make_tokenizer

    tok = make_tokenizer("qwen")
    tok.chat_template = (
        "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{%- generation %}{{- message.content + '<|im_end|>\\n' }}{%- endgeneration %}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    return tok


def test_answer_the_template_drops_is_an_error():
    from conftest import make_tokenizer

    tok = make_tokenizer("qwen")
    tok.chat_template = tok.chat_template.replace("message.content + '<|im_end|>'",
                                                  "(message.content if message.role != 'assistant' else 'X') + '<|im_end|>'")
    with pytest.raises(UserError, match="assistant message 2 .* does not appear"):
        tokenize_conversation(tok, CHAT)


def test_template_that_refuses_a_conversation_is_one_user_error():
    tok = real_template_tokenizer("gemma-2")
    with pytest.raises(UserError, match="refused this conversation: System role not supported"):
        tokenize_conversation(tok, CHAT)


def test_chat_template_kwargs_reach_training_data_and_eval_prompts(tmp_path):
    import json

    from hydra.utils import instantiate

    from conftest import compose_train
    from data.prepare import tokenize_split
    from eval.run import encode_prompt

    tok = real_template_tokenizer("qwen3")
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": CHAT[1:]}) + "\n" for i in range(4)))
    on = tokenize_split(tok, str(src), "all", max_length=None, verbose=False)
    off = tokenize_split(tok, str(src), "all", max_length=None, verbose=False, chat_template_kwargs={"enable_thinking": False})
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    n_on, n_off = sum(on[0]["loss_mask"]), sum(off[0]["loss_mask"])
    assert n_on == n_off + len(think)  # thinking on: the model writes the empty think block; off: it is in the prompt
    # the data config's key reaches the datamodule, the eval config's reaches the prompts
    cfg = compose_train([f"data.source={src}", "data.chat_template_kwargs={enable_thinking: false}"])
    assert instantiate(cfg.data, tokenizer="embedded").chat_template_kwargs == {"enable_thinking": False}
    prompt = encode_prompt(tok, CHAT[1:2], {"enable_thinking": False}).tolist()
    assert prompt[-len(think):] == think and encode_prompt(tok, CHAT[1:2]).tolist() == prompt[:-len(think)]
