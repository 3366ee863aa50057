"""``python -m eval.gpu_check`` (``make gpu-check``): the user's whole path on this machine's accelerator, one JSON.

    make gpu-check                                        # SmolLM2 on the first GPU (the CPU when none is visible)
    python -m eval.gpu_check target=hf target.name_or_path=/models/Qwen3-8B conversations=64 train_steps=200

Each stage is the command a user runs (a subprocess, as on the command line), timed:

1. ``regenerate``: ``transformers serve`` started on loopback with the target, and ``python -m data.regenerate
   endpoint=...`` through its OpenAI-compatible API (``serve=false``: in process);
2. ``features``: ``python -m data.features`` on ``device`` (the tapped layers only, by forward pre-hooks);
3. ``train``: ``python -m train`` from that cache (``features=offline``), ``trainer=gpu`` on a GPU, else the CPU;
4. ``eval``: ``python -m eval`` on ``device``, the head beside plain decoding (greedy output must equal plain);
5. ``export``: ``python -m train.export format=speculators`` (vLLM's format) with its model card.

Writes ``gpu_check.json`` into ``out_dir`` (date, machine, device, each stage's command, exit status and seconds, and
the figures: conversations regenerated, cache bytes, validation acceptance, τ and speed-up per temperature, the
export's files) and prints it; exit status 1 when a stage failed. The tests run the same command on the CPU at a tiny
size (``tests/test_gpu_check.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, cli, guard_out, run_main, write_json


def stage(name: str, module: str, overrides: list[str], log_dir: Path, timeout_s: float) -> dict:
    """Run ``python -m module overrides`` → {name, command, rc, wall_s}; its output goes to ``log_dir/<name>.log``."""
    cmd = [sys.executable, "-m", module, *overrides]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with open(log_dir / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t
    out = {"name": name, "command": "python -m " + " ".join([module, *overrides]), "rc": rc, "wall_s": round(wall, 1)}
    if rc != 0:
        tail = (log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        out["error"] = " | ".join(tail)
        print(f"[{name}] failed (exit {rc}): {out['error']}", flush=True)
    else:
        print(f"[{name}] done in {wall:.1f} s", flush=True)
    return out


def joined_shards(regen_dir: Path, out: Path) -> int:
    """The regenerated shards as one JSON Lines file (the training source) → conversations."""
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for shard in sorted(regen_dir.glob("shard-*.jsonl")):
            for line in shard.read_text(encoding="utf-8").split("\n"):
                if line.strip():
                    f.write(line + "\n")
                    n += 1
    return n


def run(cfg: DictConfig) -> dict:
    import torch

    from eval.bench_regen import machine, start_server, stop_server
    from models.target import resolve_device, resolve_path

    device = resolve_device(str(cfg.device))
    on_gpu = device.type == "cuda"
    out = guard_out(cfg.out_dir, "out_dir", lambda p: (p / "gpu_check.json").exists() or (p / "logs").is_dir(),
                    overwrite=bool(cfg.overwrite), what="a GPU check's folder")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    from hydra.core.hydra_config import HydraConfig

    target = [f"target={HydraConfig.get().runtime.choices['target']}", f"target.name_or_path={cfg.target.name_or_path}"]
    dtype = "bfloat16" if on_gpu else "float32"
    timeout = float(cfg.stage_timeout_s)
    summary: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "device": str(device),
        "command": "python -m eval.gpu_check " + " ".join(sys.argv[1:]), "settings": OmegaConf.to_container(cfg),
        "stages": [], "figures": {}}
    stages: list[dict] = summary["stages"]
    figures: dict[str, Any] = summary["figures"]

    def ok() -> bool:
        return all(s["rc"] == 0 for s in stages)

    # 1. regeneration through an OpenAI-compatible server (or in process)
    regen_dir = out / "regen"
    regen = [*target, f"data.max_conversations={cfg.conversations}", "max_turns=1", f"max_new_tokens={cfg.max_new_tokens}",
             f"out_dir={regen_dir}", "temperature=0", "overwrite=true"]
    server = None
    try:
        if cfg.serve:
            t = time.perf_counter()
            folder = resolve_path(str(cfg.target.name_or_path))
            server, api = start_server(folder, dtype, "cuda" if on_gpu else "cpu", list(cfg.serve_args),
                                       logs / "server.log", timeout_s=timeout)
            figures["server_start_s"] = round(time.perf_counter() - t, 1)
            regen += [f"endpoint={api}", f"concurrency={cfg.concurrency}"]
        else:
            regen += [f"device={device}", f"batch_size={cfg.concurrency}"]
        stages.append(stage("regenerate", "data.regenerate", regen, logs, timeout))
    finally:
        if server is not None:
            stop_server(server)
    if ok():
        n = joined_shards(regen_dir, out / "train.jsonl")
        wall = stages[-1]["wall_s"]
        figures["regenerate"] = {"conversations": n, "conversations_per_hour": round(n / max(wall, 1e-9) * 3600, 1),
                                 "through": "transformers serve" if cfg.serve else "in process"}

    # 2.-3. features on the device, then a short training from the cache
    common = [*target, f"draft={cfg.draft}", f"data.source={out / 'train.jsonl'}", "data.heldout_fraction=0.25",
              f"data.batch_size={cfg.batch_size}", f"data.max_length={cfg.max_length}", "features=offline",
              f"data.feature_dir={out / 'features'}", f"name=gpu-check-{cfg.draft}"]
    if ok():
        stages.append(stage("features", "data.features", [*common, f"device={device}", "overwrite=true"], logs, timeout))
    if ok():
        figures["features"] = {"bytes": sum(p.stat().st_size for p in (out / "features").rglob("*") if p.is_file())}
        trainer = (["trainer=gpu", "trainer.devices=1"] if on_gpu else ["trainer=cpu", "trainer.precision=32"])
        stages.append(stage("train", "train", [*common, *trainer, f"trainer.max_steps={cfg.train_steps}",
                                               f"trainer.val_check_interval={max(1, int(cfg.train_steps) // 2)}",
                                               "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
                                               f"hydra.run.dir={out / 'train'}", "overwrite=true"], logs, timeout))
    if ok():
        res = json.loads((out / "train" / "result.json").read_text())
        figures["train"] = {k: res[k] for k in res if k.startswith("val/") or k in ("global_step", "train_time_s", "train_tokens")}

    # 4. evaluation on the device: the head beside plain decoding
    if ok():
        stages.append(stage("eval", "eval", [*target, f"device={device}", f"drafters.eagle3.path={out / 'train' / 'draft'}",
                                             "drafters.draft_model=null", "eval_set=[sharegpt]", f"limit={cfg.eval_limit}",
                                             f"max_new_tokens={cfg.eval_max_new_tokens}", "k=3", f"out_dir={out / 'eval'}",
                                             "overwrite=true", "~logger"], logs, timeout))
    if ok():
        res = json.loads((out / "eval" / "results.json").read_text())["results"]
        figures["eval"] = {f"{s}/{t}": {"tau": r["eagle3"]["tau"], "speedup": r["eagle3"].get("speedup"),
                                        "greedy_identical": r["eagle3"].get("greedy_identical")}
                           for s, by_t in res.items() for t, r in by_t.items()}

    # 5. export for vLLM (speculators format) with its model card
    if ok():
        stages.append(stage("export", "train.export", [f"src={out / 'train'}", "format=speculators",
                                                       f"out={out / 'export'}", "overwrite=true"], logs, timeout))
    if ok():
        figures["export"] = sorted(p.name for p in (out / "export").iterdir())

    summary["ok"] = ok()
    summary["total_s"] = round(sum(s["wall_s"] for s in stages), 1)
    if on_gpu:
        summary["machine"]["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    write_json(out / "gpu_check.json", summary)
    print(json.dumps(summary, indent=2))
    print(f"wrote {out / 'gpu_check.json'}")
    return summary


@hydra.main(config_path="../conf", config_name="gpu_check", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    if int(cfg.conversations) < 4:
        raise UserError(f"conversations={cfg.conversations}: at least 4 (a quarter is held out for validation)")
    if not run(cfg)["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
