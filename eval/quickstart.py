"""The README's main job on the embedded default (``make quickstart``).

1. load the embedded target and prepare ShareGPT with its chat template (train and held-out splits);
2. show greedy answers to a few MT-Bench prompts;
3. train EAGLE-3 on it for a few minutes (``python -m train`` with ``train_overrides``);
4. evaluate the trained draft beside plain decoding and n-gram lookup on MT-Bench, HumanEval and ShareGPT
   held-out at T=0 and T=1 (``python -m eval`` with ``eval_overrides``) and print the acceptance table.
"""
from __future__ import annotations

import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.benchmarks import mt_bench
from data.errors import cli, instantiate
from data.prepare import tokenize_split
from data.regenerate import generate_batch


@hydra.main(config_path="../conf", config_name="quickstart", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from models.target import load_tokenizer

    t0 = time.time()
    target = instantiate(cfg.target)
    tok = load_tokenizer(cfg.target.name_or_path)
    n = sum(p.numel() for p in target.parameters())
    print(f"== target: {target.name_or_path} ({n / 1e6:.1f}M parameters, {target.num_layers} layers, vocab {target.vocab_size})")
    for split in ("train", "heldout"):
        tokenize_split(tok, cfg.data.source, split, cfg.data.heldout_fraction, cfg.data.max_length, cfg.data.truncation,
                       None, cfg.data.num_proc)
    torch.manual_seed(0)
    qs = mt_bench(limit=cfg.n_prompts)
    answers = generate_batch(target.model, tok, [q["messages"][:1] for q in qs], cfg.max_new_tokens, temperature=0.0)
    for q, a in zip(qs, answers):
        print(f"\n### {q['id']} ({q['category']})\nUSER: {q['messages'][0]['content']}\nASSISTANT: {a}")
    if not cfg.train_and_eval:
        print(f"\nquickstart done in {time.time() - t0:.0f} s")
        return
    from train.__main__ import run as train_run
    from eval.__main__ import run as eval_run

    run_dir = Path(cfg.run_dir)
    print(f"\n== training EAGLE-3 ({' '.join(cfg.train_overrides)}) -> {run_dir}")
    t1 = time.time()
    train_run(hydra.compose("train", overrides=[*cfg.train_overrides, f"run_dir={run_dir / 'train'}"]))
    print(f"training took {time.time() - t1:.0f} s")
    print(f"\n== evaluating ({' '.join(cfg.eval_overrides)})")
    eval_run(hydra.compose("eval", overrides=[f"drafters.eagle3.path={run_dir / 'train' / 'draft'}",
                                              f"out_dir={run_dir / 'eval'}", *cfg.eval_overrides]))
    print(f"\nquickstart done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
