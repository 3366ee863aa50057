"""Hardware planner: how much does verifying 1+D tokens cost, and which draft length D pays?

    python -m eval.planner                                   # the embedded target on this machine
    python -m eval.planner acceptance=runs/eval/eval/<time>/results.json drafter=eagle3 set=mtbench
    python -m eval.planner target=llama1b_random device=cuda dtype=bfloat16     # the same benchmark on a GPU

Measures T(1+D)/T(1) for D = 0..max_d: one forward of 1+D new tokens over a KV cache holding
``context`` tokens (cropped back after each), median of ``reps``. With G = query heads per KV head, the
attention tile rule keeps G·(1+D) <= 128 (NVIDIA, 2026). With per-position acceptance a_j measured by
``python -m eval`` it predicts τ(D) = 1 + Σ_{k<=D} Π_{j<=k} a_j and the free-draft bound
τ(D)·T(1)/T(1+D), recommends the D that maximises it within the tile rule, and reports the realised
speed-up beside it. Writes ``planner.json`` in the run directory.

``plan=true`` plans a training run before launch instead (:mod:`train.plan`; nothing is measured, no weights read):

    python -m eval.planner plan=true target=hf target.name_or_path=/models/Qwen3-8B draft=eagle3 trainer=fsdp devices=8 \
        batch_size=4 seq_len=2048 tokens=500000000 throughput=runs/bench/bench_train.json

builds the target from its ``config.json`` and the draft on the meta device and prints parameters, bytes per
device (weights, gradients, AdamW state, an activation estimate) replicated (trainer=gpu|ddp) and sharded (fsdp),
the feature cache's bytes per token and for ``tokens``, and hours from a measured throughput; writes ``plan.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.errors import UserError, cli, instantiate, run_main, write_json
from eval.decoding.autok import verify_costs
from models.target import resolve_device


def plan(costs: list[float], group: int, acceptance: list[float] | None) -> dict:
    ratio = [c / costs[0] for c in costs]
    tile_max = max(0, 128 // max(group, 1) - 1)
    out = {"verify_cost_ratio": [round(r, 3) for r in ratio], "query_heads_per_kv_head": group,
           "tile_rule_max_d": tile_max}
    if acceptance:
        taus, bounds = [], []
        run, tau = 1.0, 1.0
        for d in range(len(costs)):
            if d > 0:
                a = acceptance[d - 1] if d - 1 < len(acceptance) and acceptance[d - 1] is not None else 0.0
                run *= a
                tau += run
            taus.append(tau)
            bounds.append(tau / ratio[d])
        allowed = [d for d in range(len(costs)) if d <= tile_max and d <= len(acceptance)]
        best = max(allowed, key=lambda d: bounds[d])
        out.update({"predicted_tau": [round(t, 3) for t in taus], "free_draft_speedup_bound": [round(b, 3) for b in bounds],
                    "recommended_d": best, "bound_at_recommended_d": round(bounds[best], 3)})
    return out


def read_acceptance(path: str, drafter: str, set_name: str | None, temperature: str) -> tuple[list[float], dict]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"acceptance={path}: no such results.json (run `python -m eval` first)")
    try:
        res = json.loads(p.read_text())["results"]
        set_name = set_name or next(iter(res))
    except (ValueError, KeyError, TypeError, StopIteration, IsADirectoryError) as e:
        raise UserError(f"acceptance={path}: not a results.json of `python -m eval` ({type(e).__name__})") from None
    try:
        row = res[set_name][temperature][drafter]
    except KeyError:
        raise UserError(f"{path}: no result for set={set_name} {temperature} drafter={drafter}") from None
    return [a if a is not None else 0.0 for a in row["acceptance_per_position"]], row


@hydra.main(config_path="../conf", config_name="planner", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    if cfg.get("plan"):
        from train.plan import build_plan, table

        result = build_plan(cfg)
        print(table(result))
        write_json(Path(cfg.out_dir) / "plan.json", result)
        print(f"wrote {Path(cfg.out_dir) / 'plan.json'}")
        return
    device = str(resolve_device(cfg.device))
    # the acceptance file is checked before minutes of benchmark
    acc, row = (read_acceptance(cfg.acceptance, cfg.drafter, cfg.get("set"), cfg.temperature) if cfg.acceptance else (None, {}))
    target = instantiate(cfg.target)
    model = target.model.to(device)
    c = model.config
    group = c.num_attention_heads // (getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    costs = verify_costs(model, cfg.max_d, cfg.context, cfg.reps, device)
    result = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)",
              "target": str(cfg.target.name_or_path), "parameters": sum(p.numel() for p in model.parameters()),
              "context": cfg.context, "t1_ms": round(costs[0] * 1e3, 3), **plan(costs, group, acc)}
    if row:
        result.update({"drafter": cfg.drafter, "measured_tau": row.get("tau"), "realised_speedup": row.get("speedup")})
    write_json(Path(cfg.out_dir) / "planner.json", result, echo=True)


if __name__ == "__main__":
    run_main(main)
