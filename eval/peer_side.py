"""Side script of ``python -m eval.peer``, run by ``.venv-speculators/bin/python`` (torch + speculators 0.9.0, none
of our code: it imports nothing of this project).

    .venv-speculators/bin/python eval/peer_side.py job.json

Two jobs:

- ``table``: the ``datasets`` table speculators' loader reads (``input_ids``, ``loss_mask``, ``seq_len``; one row per
  conversation, ``hs_<row>.safetensors`` beside it already written by the caller) from ``rows.safetensors``
  (the tokens flattened, ``offsets`` [S+1]); saved with ``save_to_disk``.
- ``train``: ``speculators train`` (``speculators.train.cli.main``) with the job's argv, after runtime patches that let
  it run where there is no accelerator (none is applied on a GPU): the model and batches go to the CPU instead of
  ``local_rank``; ``torch.accelerator.synchronize`` of its step timer is a no-op; autocast runs on "cpu" (its fallback
  is "cuda"). On every device its ``--max-steps`` is made to stop the run (0.9.0 still trains one step in every
  remaining epoch after reaching it). Writes ``<out>/peer_train.json``: wall seconds of the training loop, steps,
  tokens seen (real tokens of the packed batches), peak memory (GPU: ``max_memory_allocated``; CPU: the process's
  peak resident set), and the checkpoint directory of the last epoch.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def build_table(job: dict) -> None:
    from datasets import Dataset
    from safetensors.torch import load_file

    rows = load_file(job["rows"])
    ids, mask, off = rows["input_ids"].long(), rows["loss_mask"].long(), rows["offsets"].long()
    spans = list(zip(off[:-1].tolist(), off[1:].tolist()))
    ds = Dataset.from_dict({"input_ids": [ids[a:b].tolist() for a, b in spans],
                            "loss_mask": [mask[a:b].tolist() for a, b in spans],
                            "seq_len": [b - a for a, b in spans]})
    ds.set_format("torch")
    ds.save_to_disk(job["out"])
    print(f"table: {len(ds)} rows -> {job['out']}", flush=True)


def patch_for_cpu(stats: dict) -> None:
    """Let speculators' trainer run on a machine without an accelerator, and count what it trains on."""
    import speculators.train.trainer as tr

    cpu = torch.accelerator.current_accelerator() is None
    if cpu:
        tr.get_local_rank = lambda: torch.device("cpu")  # Trainer moves the model and batches to local_rank
        torch.accelerator.synchronize = lambda *a, **k: None  # the step timer's sync
    init, epoch, val, save = tr.Trainer.__init__, tr.Trainer.train_epoch, tr.Trainer.val_epoch, tr.Trainer.maybe_save_checkpoint

    def patched_init(self, *a, **k):
        init(self, *a, **k)
        if cpu:
            self.device_type = "cpu"  # autocast's device (0.9.0 falls back to "cuda")

    def patched_epoch(self, ep, **k):
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            self._peer_done = True  # 0.9.0 would still train one step in this epoch (and validate and save it)
            return
        t0 = time.perf_counter()
        epoch(self, ep, **k)
        stats["train_seconds"] += time.perf_counter() - t0
        stats["steps"] = self.global_step
        stats["epochs"] += 1

    def patched_val(self, ep):
        return None if getattr(self, "_peer_done", False) else val(self, ep)

    def patched_save(self, ep, **k):
        return None if getattr(self, "_peer_done", False) else save(self, ep, **k)

    tr.Trainer.__init__, tr.Trainer.train_epoch = patched_init, patched_epoch
    tr.Trainer.val_epoch, tr.Trainer.maybe_save_checkpoint = patched_val, patched_save
    import speculators.train.cli as cli

    make = cli.create_train_val_loaders

    def counting_loaders(*a, **k):
        train, val = make(*a, **k)
        return _Counting(train, stats), val

    cli.create_train_val_loaders = counting_loaders


class _Counting:
    """A train loader that counts the real (non-padding) tokens of the batches it hands out."""

    def __init__(self, loader, stats: dict):
        self.loader, self.stats = loader, stats

    def __iter__(self):
        for b in self.loader:
            self.stats["tokens"] += int((b["document_ids"] != -1).sum()) if "document_ids" in b else int(b["lengths"].sum())
            yield b

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def train(job: dict) -> None:
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    stats = {"train_seconds": 0.0, "steps": 0, "epochs": 0, "tokens": 0}
    patch_for_cpu(stats)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    cfg = TrainConfig.resolve(job["argv"])
    train_main(cfg)
    out = Path(job["save_path"])
    epochs = sorted(int(d.name) for d in out.iterdir() if d.is_dir() and d.name.isdigit())
    stats.update(checkpoint=str(out / str(epochs[-1])) if epochs else None,
                 peak_memory_bytes=torch.cuda.max_memory_allocated() if gpu
                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 memory_kind="gpu max_memory_allocated" if gpu else "cpu peak resident set",
                 device=torch.cuda.get_device_name() if gpu else "cpu")
    (out / "peer_train.json").write_text(json.dumps(stats, indent=2))
    print(f"speculators: {stats['steps']} steps, {stats['tokens']} tokens in {stats['train_seconds']:.1f}s", flush=True)


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    {"table": build_table, "train": train}[job["kind"]](job)


if __name__ == "__main__":
    main(sys.argv[1])
