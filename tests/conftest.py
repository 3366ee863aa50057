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
    cfg = tiny_config(arch, **kw)
    cfg.mask_token_id = cfg.vocab_size - 1  # a reserved MASK id, as the embedded target has (block-diffusion drafters)
    return AutoModelForCausalLM.from_config(cfg).eval()


def write_tiny_target(path: Path, arch: str = "llama", layers: int = 4) -> Path:
    """A random-weight tiny chat model + tiny tokenizer saved in HF format (a stand-in target on disk)."""
    tok = make_tokenizer("embedded")
    model = tiny_model(arch, vocab_size=len(tok), layers=layers)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.mask_token_id = tok.convert_tokens_to_ids("<|mask|>")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_tiny_chats(path: Path, n: int = 48) -> Path:
    import json
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 2)):
                turns += [{"from": "human", "value": rng.choice(CORPUS)}, {"from": "gpt", "value": " ".join(rng.sample(CORPUS, 2))}]
            f.write(json.dumps({"id": f"chat{i}_0", "conversations": turns}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_chats(tmp_path_factory) -> Path:
    return write_tiny_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


def train_overrides(target_dir: Path, chats: Path, run_dir: Path, steps: int = 4) -> list[str]:
    """Overrides that make `python -m train` run in seconds on the tiny target."""
    return [f"target.name_or_path={target_dir}", f"data.source={chats}", f"run_dir={run_dir}", "data.heldout_fraction=0.2",
            "data.batch_size=4", "data.max_length=64", f"trainer.max_steps={steps}", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=2", "trainer.precision=32", "trainer.enable_progress_bar=false",
            "trainer.log_every_n_steps=1", "draft.ttt_steps=3"]


def compose_train(overrides: list[str]):
    """The `python -m train` config composed with ``overrides`` (no Hydra run)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)
