"""``python -m eval.bench_regen``: conversations per hour of ``python -m data.regenerate``, in process beside a server.

    python -m eval.bench_regen                                            # SmolLM2, 256 ShareGPT prompts, one turn
    python -m eval.bench_regen conversations=1024 concurrency=128 batch_size=128 max_new_tokens=256
    python -m eval.bench_regen modes=[endpoint] "serve_args=[--continuous-batching,--cb-max-batch-tokens,8192]"

On the same first ``conversations`` prompts of the split, under the same settings (greedy by default, one answer
per prompt up to ``max_new_tokens`` tokens), each mode regenerates into its own fresh folder through
:func:`data.regenerate.run`:

- ``in_process``: the target loaded in this process, batched generation (``batch_size`` chats a batch);
- ``endpoint``: ``transformers serve <target folder>`` started here on loopback (``serve_args``: continuous
  batching by default) and ``concurrency`` conversations in flight through its OpenAI-compatible API; the server
  is stopped at the end.

Per mode: wall seconds of the run (in process: the model load included; endpoint: the server's start excluded,
reported apart), conversations per hour, answer tokens (counted with the target's tokenizer) per second. Writes
``bench_regen.json`` (date, machine, command, settings, results) into ``out_dir``.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, cli, run_main, write_json

MODES = ("in_process", "endpoint")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: str, dtype: str, device: str, serve_args: list[str], log: Path,
                 timeout_s: float = 600) -> tuple[subprocess.Popen, str]:
    """``transformers serve`` on a free loopback port, its model preloaded; → (process, API base)."""
    exe = Path(sys.executable).with_name("transformers")
    port = free_port()
    cmd = [str(exe), "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--device", device, "--log-level", "warning", *serve_args]
    print("server: " + " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if Path(folder).is_dir() else None  # a local folder needs no hub
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                stop_server(proc)
                tail = log.read_text(errors="replace")[-400:].replace("\n", " ")
                raise UserError(f"transformers serve did not start (log {log}: ...{tail})") from None
            time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def answer_stats(out_dir: Path, tokenizer) -> dict:
    """Conversations and answer tokens in a regenerated folder."""
    n = tokens = 0
    for shard in sorted(out_dir.glob("shard-*.jsonl")):
        for line in shard.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                n += 1
                for m in json.loads(line)["messages"]:
                    if m["role"] == "assistant":
                        tokens += len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
    return {"conversations": n, "answer_tokens": tokens}


def machine() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__}


@hydra.main(config_path="../conf", config_name="bench_regen", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


def run(cfg: DictConfig) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from data.regenerate import run as regenerate
    from models.target import load_tokenizer, resolve_dtype, resolve_path

    bad = [m for m in cfg.modes if m not in MODES]
    if bad or not cfg.modes:
        raise UserError(f"modes={list(cfg.modes)}: use one or both of {', '.join(MODES)}")
    out_dir = Path(cfg.out_dir)
    if (out_dir / "bench_regen.json").exists():
        raise UserError(f"{out_dir}/bench_regen.json exists; give another out_dir")
    tok = load_tokenizer(cfg.target.name_or_path)
    common = [f"target.name_or_path={cfg.target.name_or_path}",
              f"target.dtype={cfg.target.dtype}", f"data.source={cfg.data.source}",
              f"data.max_conversations={cfg.conversations}", f"max_new_tokens={cfg.max_new_tokens}",
              f"max_turns={'null' if cfg.max_turns is None else cfg.max_turns}", f"temperature={cfg.temperature}",
              f"max_prompt_tokens={'null' if cfg.max_prompt_tokens is None else cfg.max_prompt_tokens}",
              f"shard_size={cfg.conversations}", f"seed={cfg.seed}", f"device={cfg.device}"]
    results: dict = {}
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    for mode in cfg.modes:
        folder = out_dir / mode
        extra, proc, start_s = [f"out_dir={folder}"], None, None
        if mode == "in_process":
            extra.append(f"batch_size={cfg.batch_size}")
        else:
            t = time.perf_counter()
            dtype = str(resolve_dtype(cfg.target.dtype)).replace("torch.", "")
            device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else ("cpu" if cfg.device == "auto" else cfg.device)
            out_dir.mkdir(parents=True, exist_ok=True)
            proc, base = start_server(resolve_path(cfg.target.name_or_path), dtype, device, list(cfg.serve_args),
                                      out_dir / "serve.log")
            start_s = time.perf_counter() - t
            extra += [f"endpoint={base}", f"concurrency={cfg.concurrency}"]
        try:
            if GlobalHydra.instance().is_initialized():  # inside this command's Hydra app: its config search path
                rcfg = compose("regenerate", overrides=common + extra)
            else:
                with initialize_config_dir(conf, version_base="1.3"):
                    rcfg = compose("regenerate", overrides=common + extra)
            t = time.perf_counter()
            regenerate(rcfg)
            wall = time.perf_counter() - t
        finally:
            if proc is not None:
                stop_server(proc)
        stats = answer_stats(folder, tok)
        results[mode] = {**stats, "wall_s": round(wall, 2), "conversations_per_hour": round(stats["conversations"] / wall * 3600, 1),
                         "answer_tokens_per_s": round(stats["answer_tokens"] / wall, 2)}
        if mode == "endpoint":
            results[mode].update(server_start_s=round(start_s, 2), serve_args=list(cfg.serve_args), concurrency=cfg.concurrency)
        else:
            results[mode].update(batch_size=cfg.batch_size)
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "command": "python -m eval.bench_regen " + " ".join(sys.argv[1:]),
              "settings": OmegaConf.to_container(cfg, resolve=True), "results": results}
    if len(results) == 2:
        report["endpoint_over_in_process"] = round(results["endpoint"]["conversations_per_hour"]
                                                   / max(results["in_process"]["conversations_per_hour"], 1e-9), 3)
    write_json(out_dir / "bench_regen.json", report)
    print(f"wrote {out_dir / 'bench_regen.json'}")
    return report


if __name__ == "__main__":
    run_main(main)
