"""``python -m eval.bench_ties``: how far apart are the logits of block verification and one-token decoding?

    python -m eval.bench_ties target=smollm2 target.dtype=bfloat16
    python -m eval.bench_ties target=smollm2 target.dtype=float32

For each prompt: prefill it, then score the next ``block`` tokens of the target's own greedy continuation
once as one block (as verification does) and once token by token (as plain decoding does), and compare
the logits at the same positions. Reports the largest difference in units of the dtype's epsilon times
the top logit's magnitude (the unit :func:`eval.decoding.lossless.tie_bound` uses) and how many positions had a
top-1/top-2 margin inside the bound. Writes ``bench_ties.json``.
"""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.errors import cli, instantiate, run_main, write_json
from eval.decoding.kvcache import new_cache
from eval.decoding.lossless import TIE_ULPS


@torch.no_grad()
def logit_gaps(target, prompts: list[torch.Tensor], block: int = 8) -> list[float]:
    """Per position: max |Δlogit| between block and step-by-step scoring, in ulps of the top logit."""
    from eval.decoding.decoder import crop

    eps = torch.finfo(next(target.parameters()).dtype).eps
    lm = target.model.lm_head
    ulps = []
    for ids in prompts:
        ids = ids.view(1, -1)
        cache = new_cache()
        out = target(ids, cache=cache, use_cache=True)
        toks = [int(lm(out.last_state[:, -1:])[0, -1].argmax())]
        steps = []
        for _ in range(block):  # plain decoding, token by token
            o = target(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
            steps.append(lm(o.last_state)[0, -1].float())
            toks.append(int(steps[-1].argmax()))
        crop(cache, ids.shape[1])
        o = target(torch.tensor([toks[:block]]), cache=cache, use_cache=True)  # the same tokens as one verify block
        blk = lm(o.last_state)[0].float()  # [block, V]
        for b, s in zip(blk, steps):
            ulps.append(float((b - s).abs().max()) / (eps * max(float(s.abs().max()), 1.0)))
    return ulps


@hydra.main(config_path="../conf", config_name="bench_ties", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from data.benchmarks import mt_bench
    from eval.run import encode_prompt
    from models.target import load_tokenizer

    target = instantiate(cfg.target)
    tok = load_tokenizer(cfg.target.name_or_path)
    prompts = [encode_prompt(tok, q["messages"][:1]) for q in mt_bench(limit=cfg.prompts)]
    gaps = sorted(logit_gaps(target, prompts, cfg.block))
    q = lambda f: round(gaps[min(len(gaps) - 1, int(f * len(gaps)))], 2)  # noqa: E731
    res = {"target": str(cfg.target.name_or_path), "dtype": str(next(target.parameters()).dtype),
           "positions": len(gaps), "block": cfg.block, "ulps_median": q(0.5), "ulps_p90": q(0.9),
           "ulps_max": round(gaps[-1], 2), "tie_ulps_default": TIE_ULPS.get(next(target.parameters()).dtype)}
    write_json(Path(cfg.out_dir) / "bench_ties.json", res, echo=True)


if __name__ == "__main__":
    run_main(main)
