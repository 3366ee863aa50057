"""Train the embedded target's byte-level BPE tokenizer, with a ChatML-style chat template.

Special tokens: ``<|endoftext|>`` (document separator and padding), ``<|im_start|>``, ``<|im_end|>``
(end of turn: what generation stops on), and ``<|mask|>``, reserved for block-diffusion drafters
(DFlash/DSpark fill a block with it; it never occurs in text).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def conversation_texts(dataset: Iterable[dict]) -> Iterator[str]:
    """The message contents of a conversation dataset, one string per turn."""
    for row in dataset:
        for m in row["messages"]:
            yield m["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, max_chars: int | None = None):
    """Train a byte-level BPE on ``texts`` and return a ``PreTrainedTokenizerFast`` with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def capped() -> Iterator[str]:
        n = 0
        for t in texts:
            yield t
            n += len(t)
            if max_chars is not None and n >= max_chars:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(capped(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|mask|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    return fast


def save_tokenizer(tokenizer, path: str | Path) -> None:
    tokenizer.save_pretrained(str(path))
