"""Offline target features: sharded safetensors written once, memory-mapped at training time.

    python -m data.features                       # same config as `python -m train` (target, taps, data)
    python -m train features=offline              # train from the cache

A split directory holds ``shard-r{rank}-{k}.safetensors`` files and one ``manifest-r{rank}.json`` per
writer rank (DDP writes one set per rank). Each shard stores the samples' tokens flattened:
``input_ids`` [N], ``loss_mask`` [N], ``tap_states`` [N, n_taps, d], ``last_state`` [N, d] and
``offsets`` [S+1]; its header and the manifest record the target identity, tap layers, dtype and
sample count, and the manifest a SHA-256 per shard, checked when the cache is opened.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from data.errors import UserError, atomic_file, cli, guard_out, instantiate, run_main, sha256

CACHE_FORMAT = "draftsmith-features/1"


def collate(rows: list[dict[str, Any]], pad_id: int = 0, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples to the longest (rounded up to ``multiple``)."""
    T = max(len(r["input_ids"]) for r in rows)
    T = -(-T // multiple) * multiple
    B = len(rows)
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        out["loss_mask"][i, :n] = torch.as_tensor(r["loss_mask"])
        out["attention_mask"][i, :n] = 1
    for key in ("tap_states", "last_state"):
        if key in rows[0]:
            first = torch.as_tensor(rows[0][key])
            buf = torch.zeros((B, T) + tuple(first.shape[1:]), dtype=first.dtype)
            for i, r in enumerate(rows):
                x = torch.as_tensor(r[key])
                buf[i, : x.shape[0]] = x
            out[key] = buf
    return out


def build_target(cfg: DictConfig) -> Any:
    """The frozen target of a training config with the tap layers the head family wants (unless the config names them)."""
    from models.target import default_tap_layers

    target = instantiate(cfg.target, tap_layers=None)
    head_cls = hydra.utils.get_class(cfg.draft._target_)
    taps = cfg.target.tap_layers
    if taps is None:
        taps = default_tap_layers(target.num_layers, head_cls.tap_method, cfg.get("n_taps", 5))
    target.set_tap_layers(list(taps))
    return target


def identity_of(target: Any, taps: bool = True) -> dict:
    """What a feature cache must match: the target, and its tap layers unless the head reads none (``taps=False``:
    the final-norm feature every cache holds is all it reads)."""
    return {"target": target.identity(), **({"tap_layers": list(target.tap_layers)} if taps else {})}


@torch.no_grad()
def write_features(target: Any, ds, out_dir: str | Path, batch_size: int = 8, shard_samples: int = 256,
                   dtype: str = "bfloat16", rank: int = 0, world_size: int = 1) -> dict:
    """Run the frozen target over this rank's share of ``ds`` (rows with ``input_ids``, ``loss_mask``) and write shards."""
    from safetensors.torch import save_file

    from models.target import DTYPES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ident = identity_of(target)
    rows = [ds[i] for i in range(rank, len(ds), world_size)]
    manifest = {"format": CACHE_FORMAT, **ident, "dtype": dtype, "rank": rank, "world_size": world_size, "shards": []}
    tokens = 0
    device = next(target.parameters()).device
    for s in range(0, len(rows), shard_samples):
        part = rows[s: s + shard_samples]
        ids, mask, taps, last, offsets = [], [], [], [], [0]
        for b in range(0, len(part), batch_size):
            if b and b % (8 * batch_size) == 0:
                print(f"  {s + b}/{len(rows)} samples", flush=True)
            batch = collate(part[b: b + batch_size])
            feats = target(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
            for i, r in enumerate(part[b: b + batch_size]):
                n = len(r["input_ids"])
                ids.append(torch.as_tensor(r["input_ids"]))
                mask.append(torch.as_tensor(r["loss_mask"]))
                taps.append(feats.tap_states[i, :n].to(DTYPES[dtype]).cpu())
                last.append(feats.last_state[i, :n].to(DTYPES[dtype]).cpu())
                offsets.append(offsets[-1] + n)
        tensors = {"input_ids": torch.cat(ids).to(torch.int32), "loss_mask": torch.cat(mask).to(torch.uint8),
                   "tap_states": torch.cat(taps).contiguous(), "last_state": torch.cat(last).contiguous(),
                   "offsets": torch.tensor(offsets, dtype=torch.int64)}
        name = f"shard-r{rank}-{s // shard_samples:05d}.safetensors"
        meta = {"format": CACHE_FORMAT, "identity": json.dumps(ident), "dtype": dtype, "samples": str(len(part))}
        tmp = out / f".{name}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / name)
        manifest["shards"].append({"file": name, "samples": len(part), "tokens": offsets[-1], "sha256": sha256(out / name)})
        tokens += offsets[-1]
    with atomic_file(out / f"manifest-r{rank}.json") as f:
        json.dump(manifest, f, indent=2)
    size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    return {"samples": len(rows), "tokens": tokens, "bytes": size, "bytes_per_token": size / max(1, tokens)}


class FeatureDataset(torch.utils.data.Dataset):
    """Samples of an offline feature cache (memory-mapped), checked against the expected target identity."""

    def __init__(self, split_dir: str | Path, expect: dict | None = None, verify: bool = True):
        from safetensors import safe_open

        d = Path(split_dir)
        manifests = sorted(d.glob("manifest-r*.json"))
        if not manifests:
            raise UserError(f"{d}: no feature cache here (no manifest-r*.json); write it with `python -m data.features`")
        self.index: list[tuple[int, int]] = []
        self.files = []
        for mpath in manifests:
            try:
                m = json.loads(mpath.read_text())
            except json.JSONDecodeError:
                raise UserError(f"{mpath}: corrupted manifest; rewrite the cache with `python -m data.features`") from None
            self.tap_layers = m.get("tap_layers")
            got = {k: m.get(k) for k in (expect or {})}
            if expect is not None and got != expect:
                diff = [k for k in ("target", "tap_layers") if got.get(k) != expect.get(k)]
                raise UserError(f"{mpath}: feature cache was built for {diff[0]}={got.get(diff[0])}, but this run uses "
                                f"{expect.get(diff[0])}; rebuild it with `python -m data.features` or point data.feature_dir elsewhere")
            for s in m["shards"]:
                p = d / s["file"]
                if not p.exists():
                    raise UserError(f"{p}: shard listed in {mpath.name} is missing; rebuild the cache")
                if verify and sha256(p) != s["sha256"]:
                    raise UserError(f"{p}: checksum mismatch (truncated or corrupted shard); rebuild the cache")
                try:
                    f = safe_open(str(p), framework="pt")
                except Exception as e:  # safetensors raises its own error types on a damaged header
                    raise UserError(f"{p}: unreadable shard ({e}); rebuild the cache") from None
                offsets = f.get_tensor("offsets")
                fi = len(self.files)
                self.files.append((f, offsets))
                self.index += [(fi, i) for i in range(len(offsets) - 1)]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        fi, j = self.index[i]
        f, offsets = self.files[fi]
        a, b = int(offsets[j]), int(offsets[j + 1])
        return {k: f.get_slice(k)[a:b] for k in ("input_ids", "loss_mask", "tap_states", "last_state")}


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    """Write the offline feature cache for the train and held-out splits of a training config."""
    target = build_target(cfg)
    dm = instantiate(cfg.data, tokenizer=cfg.target.name_or_path)
    if cfg.data.feature_dir is not None and not isinstance(cfg.data.feature_dir, str):
        raise UserError(f"data.feature_dir={list(cfg.data.feature_dir)}: `python -m data.features` writes one cache; "
                        "give one directory (training reads a list)")
    out = Path(cfg.data.feature_dir or f"runs/features/{cfg.name}")
    guard_out(out, "data.feature_dir", ("train", "heldout"), overwrite=bool(cfg.get("overwrite")), what="a feature cache of ours")
    w = cfg.get("features_writer") or {}
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for split in ("train", "heldout"):
        stats = write_features(target, dm.split(split), out / split, batch_size=w.get("batch_size", 8),
                               shard_samples=w.get("shard_samples", 256), dtype=w.get("dtype", "bfloat16"),
                               rank=rank, world_size=world)
        print(f"{split}: {stats['samples']} samples, {stats['tokens']:,} tokens, {stats['bytes'] / 2**20:.1f} MiB, "
              f"{stats['bytes_per_token']:.0f} bytes/token (rank {rank}/{world}) -> {out / split}")


if __name__ == "__main__":
    run_main(main)
