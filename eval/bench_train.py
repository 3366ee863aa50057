"""Training-throughput benchmark: online vs offline features, draft step vs target forward, cache bytes per token.

    python -m eval.bench_train                          # EAGLE-3 on the embedded target (the train config)
    python -m eval.bench_train draft=eagle3 +bench.steps=20 +bench.precisions=[32]

Uses the same config as ``python -m train``. For each precision it times, on the same batches side by
side: the frozen target's forward alone, the head's training step (forward, backward, AdamW) given the
features, a whole online step (both), and a whole offline step (memory-mapped cache read + collate +
head step). Writes ``bench_train.json`` into the run directory and prints it.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.errors import cli, run_main, write_json


def autocast(precision: str):
    if str(precision).startswith("bf16"):
        return torch.autocast("cpu" if not torch.cuda.is_available() else "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def bench(cfg: DictConfig) -> dict:
    from data.datamodule import collate
    from data.features import FeatureDataset, write_features
    from train.build import build
    from train.module import DraftModule

    b = cfg.get("bench") or {}
    steps, warmup = int(b.get("steps", 8)), int(b.get("warmup", 2))
    precisions = [str(p) for p in b.get("precisions", ["32", "bf16-mixed"])]
    torch.manual_seed(cfg.seed)
    target, head, dm = build(cfg)
    dm.max_conversations = max(steps * dm.batch_size, 8)  # only what the benchmark reads
    ds = dm.split("train")
    head.prepare_from_data(dm.token_counts())
    rows = [ds[i] for i in range(min(len(ds), steps * dm.batch_size))]
    batches = [collate(rows[i: i + dm.batch_size]) for i in range(0, len(rows), dm.batch_size)]
    n_tok = sum(int(x["attention_mask"].sum()) for x in batches)
    module = DraftModule(target, head, **cfg.optim)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-5)
    result: dict = {"target": target.name_or_path, "head": head.family, "tap_layers": target.tap_layers,
                    "batches": len(batches), "batch_size": dm.batch_size, "tokens": n_tok,
                    "trainable_params": sum(p.numel() for p in head.parameters() if p.requires_grad),
                    "torch_threads": torch.get_num_threads(), "precisions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cache = write_features(target, rows, Path(tmp) / "train", batch_size=dm.batch_size,
                               dtype=(cfg.get("features_writer") or {}).get("dtype", "bfloat16"))
        result["cache_bytes_per_token"] = round(cache["bytes_per_token"], 1)
        offline = FeatureDataset(Path(tmp) / "train")
        off_batches = [list(range(i, min(i + dm.batch_size, len(offline)))) for i in range(0, len(offline), dm.batch_size)]
        for prec in precisions:
            def target_fwd():
                with autocast(prec):
                    for x in batches:
                        module.features(x)

            feats = [module.features(x) for x in batches]

            def head_step():
                for x, f in zip(batches, feats):
                    with autocast(prec):
                        loss = head.training_loss(x, f).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            def online_step():
                for x in batches:
                    with autocast(prec):
                        loss = module._step(x).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            def offline_step():
                for idx in off_batches:
                    x = collate([offline[i] for i in idx])
                    with autocast(prec):
                        loss = module._step(x).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            if warmup:
                for fn in (target_fwd, head_step, online_step, offline_step):
                    fn()
            t_target, t_head = timed(target_fwd, 1), timed(head_step, 1)
            t_online, t_offline = timed(online_step, 1), timed(offline_step, 1)
            result["precisions"][prec] = {
                "online_tokens_per_s": round(n_tok / t_online, 1),
                "offline_tokens_per_s": round(n_tok / t_offline, 1),
                "target_forward_tokens_per_s": round(n_tok / t_target, 1),
                "head_step_over_target_forward": round(t_head / t_target, 2),
            }
    return result


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    result = bench(cfg)
    write_json(Path(cfg.run_dir) / "bench_train.json", result, echo=True)


if __name__ == "__main__":
    run_main(main)
