"""Tokenise a conversation split with a target's chat template into ``input_ids`` + ``loss_mask`` (Arrow-cached).

    python -m data.prepare                                  # ShareGPT with the embedded target's template
    python -m data.prepare data.source=my.jsonl data.max_length=1024 data.truncation=drop
    python -m data.prepare "data.source=[greedy.jsonl,sampled.jsonl]"   # several sources, interleaved
    python -m data.prepare target=qwen3 "data.chat_template_kwargs={enable_thinking:false}"   # template options

The result is cached by ``datasets`` next to the conversation cache (same input → no recomputation).
"""
from __future__ import annotations


import hydra
from omegaconf import DictConfig

from data.chat import TRUNCATION_POLICIES, tokenize_conversation
from data.conversations import Source, load_conversations, source_name
from data.errors import UserError, cli, run_main


def tokenize_split(tokenizer, source: Source = "sharegpt", split: str = "train", heldout_fraction: float = 0.02,
                   max_length: int | None = 2048, truncation: str = "turn", max_conversations: int | None = None,
                   num_proc: int = 1, verbose: bool = True, chat_template_kwargs: dict | None = None,
                   hub_split: str = "train"):
    """Conversations of a split → ``datasets.Dataset`` with ``id``, ``input_ids`` and ``loss_mask``; drops are reported.
    ``chat_template_kwargs`` go to the chat template (``{"enable_thinking": False}``); ``hub_split`` is the split of
    a Hugging Face dataset source that is read."""
    if truncation not in TRUNCATION_POLICIES:
        raise UserError(f"data.truncation={truncation!r}: use one of {', '.join(TRUNCATION_POLICIES)}")
    ds = load_conversations(source, split, heldout_fraction, verbose=verbose, hub_split=hub_split)
    kwargs = {str(k): v for k, v in dict(chat_template_kwargs or {}).items()}
    if max_conversations:
        ds = ds.select(range(min(max_conversations, len(ds))))
    if len(ds) == 0:
        raise UserError(f"{source_name(source)}: its {split} split is empty (heldout_fraction={heldout_fraction} of the conversations, "
                        "chosen by a hash of their id); give more conversations or a larger heldout_fraction")

    def encode(batch):
        ids, masks, keep = [], [], []
        for msgs in batch["messages"]:
            enc = tokenize_conversation(tokenizer, msgs, max_length, truncation, kwargs)
            keep.append(enc is not None)
            ids.append(enc["input_ids"] if enc else [])
            masks.append(enc["loss_mask"] if enc else [])
        return {"input_ids": ids, "loss_mask": masks, "kept": keep}

    enc = ds.map(encode, batched=True, remove_columns=["messages", "bucket"], num_proc=num_proc,
                 desc=f"tokenise {split}")
    n_dropped = len(enc) - sum(enc["kept"])
    enc = enc.filter(lambda k: k, input_columns="kept").remove_columns("kept")
    if len(enc) == 0:
        raise UserError(f"{source_name(source)}/{split}: no conversation left after tokenisation "
                        f"({n_dropped} dropped by truncation={truncation}, max_length={max_length})")
    if verbose:
        n_tok = sum(len(x) for x in enc["input_ids"])
        n_asst = sum(sum(x) for x in enc["loss_mask"])
        print(f"{split}: {len(enc)} conversations, {n_tok:,} tokens ({n_asst:,} in the loss mask); "
              f"dropped {n_dropped} (over max_length={max_length}, truncation={truncation})")
    return enc


@hydra.main(config_path="../conf", config_name="prepare", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from models.target import load_tokenizer

    tok = load_tokenizer(cfg.target.name_or_path)
    for split in cfg.splits:
        tokenize_split(tok, cfg.data.source, split, cfg.data.heldout_fraction, cfg.data.max_length,
                       cfg.data.truncation, cfg.data.max_conversations, cfg.data.num_proc,
                       chat_template_kwargs=cfg.data.get("chat_template_kwargs"), hub_split=cfg.data.get("hub_split", "train"))


if __name__ == "__main__":
    run_main(main)
