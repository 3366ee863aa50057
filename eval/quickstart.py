"""The README's main job on the embedded default (``make quickstart``).

For now: load the embedded target, prepare the ShareGPT data with its chat template, and show greedy
answers to MT-Bench prompts. (Drafter training and acceptance evaluation join as they land.)
"""
from __future__ import annotations

import json
import time

import hydra
import torch
from omegaconf import DictConfig

from data.benchmarks import mt_bench
from data.errors import cli
from data.prepare import tokenize_split
from data.regenerate import generate_batch
from train.build import instantiate


@hydra.main(config_path="../conf", config_name="quickstart", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    t0 = time.time()
    target = instantiate(cfg.target)
    from models.target import load_tokenizer

    tok = load_tokenizer(cfg.target.name_or_path)
    n = sum(p.numel() for p in target.parameters())
    print(f"target: {target.name_or_path} ({n / 1e6:.1f}M parameters, {target.num_layers} layers, vocab {target.vocab_size}); "
          f"tap layers {target.tap_layers}")
    for split in ("train", "heldout"):
        tokenize_split(tok, cfg.data.source, split, cfg.data.heldout_fraction, cfg.data.max_length, cfg.data.truncation,
                       cfg.data.max_conversations, cfg.data.num_proc)
    torch.manual_seed(0)
    qs = mt_bench(limit=cfg.n_prompts)
    answers = generate_batch(target.model, tok, [q["messages"][:1] for q in qs], cfg.max_new_tokens, temperature=0.0)
    for q, a in zip(qs, answers):
        print(f"\n### {q['id']} ({q['category']})\nUSER: {q['messages'][0]['content']}\nASSISTANT (greedy, {cfg.max_new_tokens} tokens max): {a}")
    print(f"\nquickstart done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
