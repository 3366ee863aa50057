"""Shared fixtures: tiny tokenizers with real chat templates and tiny random-weight targets (no download)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = [
    "Hello! How can I help you today?", "Write a poem about the sea.", "The sea is wide and deep and blue.",
    "def add(a, b):\n    return a + b\n", "Sure, here is a short answer.", "What is the capital of France?",
    "Paris is the capital of France.", "Thanks a lot!", "You are a helpful assistant.",
] * 20

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tokenizer(kind: str):
    """A tiny byte-level BPE with the special tokens and chat template of `kind` (embedded | llama3 | qwen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data.tokenizer import train_tokenizer

    if kind == "embedded":
        return train_tokenizer(CORPUS, vocab_size=400)
    specials = {"llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama3":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                       pad_token="<|eot_id|>")
        fast.chat_template = LLAMA3_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        fast.chat_template = QWEN_TEMPLATE
    return fast


@pytest.fixture(params=["embedded", "llama3", "qwen"])
def chat_tokenizer(request):
    return request.param, make_tokenizer(request.param)


def tiny_config(arch: str, vocab_size: int = 128, layers: int = 4):
    """Random-weight tiny configs of real architectures."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=8)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(arch)


def tiny_model(arch: str, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kw)).eval()
