"""Build a retrieval datastore (:mod:`eval.decoding.datastore`) from conversations: the assistant turns of the
target's own answers, tokenised with its chat template exactly as training masks them.

    python -m eval.datastore target=smollm2 sources=[runs/regen-smollm2/greedy] out=runs/smollm2-datastore
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from data.errors import UserError, atomic_dir, cli, guard_out, run_main
from eval.decoding.datastore import FORMAT


DATASTORE_FILES = ("tokens.safetensors", "datastore.json")  # all a datastore folder holds (it is replaced whole)


def source_files(source: str) -> list[str]:
    """A source: a conversations file, ``sharegpt``, or a directory whose ``*.jsonl`` files are read (in name order:
    ``data.regenerate``'s shards)."""
    p = Path(source)
    if p.is_dir():
        files = sorted(str(f) for f in p.glob("*.jsonl"))
        if not files:
            raise UserError(f"sources: {source} is a directory without .jsonl files")
        return files
    return [source]


def build_tokens(tokenizer: Any, sources: list[str], max_conversations: int | None = None,
                 heldout_fraction: float = 0.02) -> tuple[torch.Tensor, dict]:
    """The assistant turns of the training split of ``sources`` as one int32 array, −1 after each answer, and counts.
    The held-out split (``heldout_fraction`` by id hash, as everywhere: ``data.conversations``) is left out, so
    ShareGPT's held-out evaluation prompts never find their own answers here."""
    from data.chat import tokenize_conversation
    from data.conversations import load_conversations

    out: list[int] = []
    n_conv = n_ans = 0
    for source in sources:
        for f in source_files(source):
            convs = load_conversations(f, "train", heldout_fraction, verbose=False)
            for c in convs:
                if max_conversations is not None and n_conv >= max_conversations:
                    break
                enc = tokenize_conversation(tokenizer, c["messages"])
                if enc is None:
                    continue
                n_conv += 1
                prev = 0
                for t, m in zip(enc["input_ids"], enc["loss_mask"]):
                    if m:
                        out.append(t)
                    elif prev:
                        out.append(-1)
                        n_ans += 1
                    prev = m
                if prev:
                    out.append(-1)
                    n_ans += 1
    if not out:
        raise UserError(f"sources={sources}: no assistant turn found")
    tokens = torch.tensor(out, dtype=torch.int32)
    return tokens, {"conversations": n_conv, "answers": n_ans, "answer_tokens": int((tokens >= 0).sum())}


def write_datastore(out: str | Path, tokens: torch.Tensor, info: dict) -> None:
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file({"tokens": tokens.to(torch.int32).contiguous()}, str(tmp / "tokens.safetensors"))
        (tmp / "datastore.json").write_text(json.dumps({"format": FORMAT, **info}, indent=2) + "\n")


@hydra.main(config_path="../conf", config_name="datastore", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from models.target import load_tokenizer

    sources = list(cfg.sources or [])
    if not sources:
        raise UserError("sources=[]: give the conversations to draft from, e.g. sources=[runs/regen/greedy] "
                        "(data.regenerate's shards: the target's own answers)")
    if not cfg.out:
        raise UserError("out=: the directory to write the datastore to")
    guard_out(cfg.out, "out", DATASTORE_FILES, sources=[s for s in sources if s != "sharegpt"],
              overwrite=bool(cfg.get("overwrite")), what="a datastore of ours")
    tok = load_tokenizer(cfg.target.name_or_path)
    tokens, counts = build_tokens(tok, sources, cfg.max_conversations, cfg.heldout_fraction)
    info = {"target": {"name_or_path": str(cfg.target.name_or_path), "tokenizer_size": len(tok)},
            "sources": sources, "heldout_fraction": cfg.heldout_fraction, **counts}
    if cfg.get("note"):
        info["note"] = str(cfg.note)
    write_datastore(cfg.out, tokens, info)
    print(f"datastore: {counts['answers']} answers, {counts['answer_tokens']} tokens from {counts['conversations']} "
          f"conversations -> {cfg.out}")


if __name__ == "__main__":
    run_main(main)
