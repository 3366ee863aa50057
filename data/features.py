"""Offline target features: sharded safetensors written as the target runs, memory-mapped at training time.

    python -m data.features                       # same config as `python -m train` (target, taps, data)
    python -m data.features device=cuda:1         # device: auto (the first GPU when one is visible, else the CPU)
    torchrun --nproc-per-node 8 -m data.features  # each rank its share of the samples, on cuda:LOCAL_RANK (or the CPU)
    python -m train features=offline              # train from the cache

A split directory holds ``shard-r{rank}-{k}.safetensors`` files and one ``manifest-r{rank}.json`` per
writer rank. Each shard stores the samples' tokens flattened: ``input_ids`` [N], ``loss_mask`` [N],
``tap_states`` [N, n_taps, d], ``last_state`` [N, d] and ``offsets`` [S+1]; a shard is written as soon as it
is full, so no more than one shard of states is ever held. The tap states are the target's forward pre-hooks'
(:class:`models.target.FrozenTarget`: the residual stream entering the layer after each tap, what serving engines
collect), never every layer's ``output_hidden_states``.

The cache is keyed by what made it: the target identity, the tap layers, the data (source, lengths, conversation
counts, split, chat template arguments: :meth:`data.datamodule.DraftDataModule.data_key`) and the rank layout
(``world_size``; every rank's manifest present, none from another layout). Opening checks each shard's size and
header against its manifest (cheap; ``verify="sha256"`` reads every byte); ``python -m data.features`` keeps a
split that is complete and matches, and rewrites one that does not (other settings, damaged, or a leftover of
another rank layout), so a damaged cache is rebuilt, never trusted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from data.errors import UserError, atomic_file, cli, guard_out, instantiate, public, run_main, sha256

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


def build_target(cfg: DictConfig, device: str | None = None) -> Any:
    """The frozen target of a training config with the tap layers the head family wants (unless the config names them).

    ``device``: where it runs (None: where ``trainer.accelerator`` will run it, :func:`train_device`). A head that reads taps (EAGLE-3, DFlash,
    DSpark, which export to serving engines) may not tap the last layer's output, which no engine collects
    (:func:`models.target.check_collectable`)."""
    from models.target import check_collectable, default_tap_layers

    target = instantiate(cfg.target, tap_layers=None, device=device or train_device(cfg))
    head_cls = hydra.utils.get_class(cfg.draft._target_)
    taps = cfg.target.tap_layers
    if taps is None:
        taps = default_tap_layers(target.num_layers, head_cls.tap_method, cfg.get("n_taps", 5))
    if getattr(head_cls, "reads_taps", True):
        check_collectable(list(taps), target.num_layers, "target.tap_layers")
    target.set_tap_layers(list(taps))
    return target


def train_device(cfg: DictConfig) -> str:
    """Where a training run's trainer puts the target: ``cuda:LOCAL_RANK`` (or ``cuda``) for ``trainer.accelerator``
    gpu/cuda, a visible GPU for auto, else the CPU. Built there, a target on a GPU times and packs no CPU kernels."""
    acc = str((cfg.get("trainer") or {}).get("accelerator", "cpu"))
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cuda"
    return "cpu"


def identity_of(target: Any, taps: bool = True) -> dict:
    """What a feature cache must match: the target, and its tap layers unless the head reads none (``taps=False``:
    the final-norm feature every cache holds is all it reads)."""
    return {"target": target.identity(), **({"tap_layers": list(target.tap_layers)} if taps else {})}


def _rank_of(name: str) -> int | None:
    """The writer rank in a cache file name (``shard-r3-00000.safetensors``, ``manifest-r3.json``)."""
    stem = name.split("-")[1] if name.count("-") >= 1 else ""
    stem = stem.split(".")[0]
    return int(stem[1:]) if stem.startswith("r") and stem[1:].isdigit() else None


def clear_rank(out: Path, rank: int, world_size: int) -> None:
    """Remove this rank's files (its manifest first, so a half-rewritten split is never taken for a complete one);
    rank 0 also removes those of ranks outside ``0..world_size-1`` (an earlier run with more ranks), so their
    samples are not read twice beside this layout's."""
    for p in sorted(out.glob("manifest-r*.json")) + sorted(out.glob("shard-r*.safetensors")) + sorted(out.glob(".shard-r*")):
        r = _rank_of(p.name.lstrip("."))
        if r == rank or (rank == 0 and (r is None or r >= world_size)):
            p.unlink(missing_ok=True)


def _tokens_of(ds, indices: range) -> int:
    try:
        return sum(len(ds[i]["input_ids"]) for i in indices)
    except (KeyError, TypeError):
        return 0


@torch.no_grad()
def write_features(target: Any, ds, out_dir: str | Path, batch_size: int = 8, shard_samples: int = 256,
                   dtype: str = "bfloat16", rank: int = 0, world_size: int = 1, data: dict | None = None,
                   progress: bool = False) -> dict:
    """Run the frozen target over this rank's share of ``ds`` (rows with ``input_ids``, ``loss_mask``; rank r takes
    rows r, r + world_size, ...) and write its shards, one as soon as it is full. ``data``: the settings that made
    ``ds`` (recorded in the manifest, checked when training opens the cache). ``progress``: progress in tokens (:class:`data.progress.Progress`)
    (rate and time left)."""
    from safetensors.torch import save_file

    from models.target import DTYPES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clear_rank(out, rank, world_size)
    ident = identity_of(target)
    mine = range(rank, len(ds), world_size)
    manifest = {"format": CACHE_FORMAT, **ident, **({"data": data} if data is not None else {}), "dtype": dtype,
                "rank": rank, "world_size": world_size, "shards": []}
    device = next(target.parameters()).device
    bar = None
    if progress:  # the one progress display: a bar on a terminal, a line every 30 s on a pipe or in a log
        from data.progress import Progress

        bar = Progress(_tokens_of(ds, mine), f"features {out.name} r{rank}/{world_size}", unit="tokens")
    tokens = 0
    try:
        for s in range(0, len(mine), shard_samples):
            part = [ds[i] for i in mine[s: s + shard_samples]]
            ids, mask, taps, last, offsets = [], [], [], [], [0]
            for b in range(0, len(part), batch_size):
                rows = part[b: b + batch_size]
                batch = collate(rows)
                feats = target(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
                for i, r in enumerate(rows):
                    n = len(r["input_ids"])
                    ids.append(torch.as_tensor(r["input_ids"]))
                    mask.append(torch.as_tensor(r["loss_mask"]))
                    taps.append(feats.tap_states[i, :n].to(DTYPES[dtype]).cpu())  # [n, n_taps, d]
                    last.append(feats.last_state[i, :n].to(DTYPES[dtype]).cpu())  # [n, d]
                    offsets.append(offsets[-1] + n)
                if bar is not None:
                    bar.update(sum(len(r["input_ids"]) for r in rows))
            tensors = {"input_ids": torch.cat(ids).to(torch.int32), "loss_mask": torch.cat(mask).to(torch.uint8),
                       "tap_states": torch.cat(taps).contiguous(), "last_state": torch.cat(last).contiguous(),
                       "offsets": torch.tensor(offsets, dtype=torch.int64)}
            del ids, mask, taps, last
            name = f"shard-r{rank}-{s // shard_samples:05d}.safetensors"
            meta = {"format": CACHE_FORMAT, "identity": json.dumps(ident), "dtype": dtype, "samples": str(len(part))}
            tmp = out / f".{name}.tmp-{os.getpid()}"
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(public(tmp), out / name)  # save_file writes 0600: the mode the umask allows
            manifest["shards"].append({"file": name, "samples": len(part), "tokens": offsets[-1],
                                       "bytes": (out / name).stat().st_size, "sha256": sha256(out / name)})
            tokens += offsets[-1]
            del tensors
    finally:
        if bar is not None:
            bar.close()
    with atomic_file(out / f"manifest-r{rank}.json") as f:
        json.dump(manifest, f, indent=2)
    size = sum(s["bytes"] for s in manifest["shards"])
    return {"samples": len(mine), "tokens": tokens, "bytes": size, "bytes_per_token": size / max(1, tokens)}


def read_manifests(d: Path) -> list[tuple[Path, dict]]:
    """A split's manifests, checked to form one rank layout: every one records the same ``world_size`` and the
    ranks 0..world_size-1 are each there once (a leftover of another layout would add its samples twice)."""
    paths = sorted(d.glob("manifest-r*.json"))
    if not paths:
        raise UserError(f"{d}: no feature cache here (no manifest-r*.json); write it with `python -m data.features`")
    out = []
    for mpath in paths:
        try:
            m = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{mpath}: corrupted manifest; rewrite the cache with `python -m data.features`") from None
        if not isinstance(m, dict) or not isinstance(m.get("shards"), list):
            raise UserError(f"{mpath}: not a feature-cache manifest; rewrite the cache with `python -m data.features`")
        out.append((mpath, m))
    worlds = {int(m.get("world_size", 1)) for _, m in out}
    ranks = sorted(int(m.get("rank", 0)) for _, m in out)
    if len(worlds) > 1 or ranks != list(range(next(iter(worlds)))):
        raise UserError(f"{d}: manifests of ranks {ranks} written by runs of {sorted(worlds)} processes (an earlier run's "
                        "left beside a later one's, or a run that did not finish); rewrite the cache with `python -m data.features`")
    return out


def check_shard(p: Path, entry: dict, mpath: Path, verify: str | bool) -> None:
    """One shard against its manifest entry: present, its size (when recorded), its whole SHA-256 (``verify="sha256"``)."""
    if not p.exists():
        raise UserError(f"{p}: shard listed in {mpath.name} is missing; rebuild the cache")
    if verify == "sha256" or (verify and "bytes" not in entry):  # caches of earlier versions record no size
        if sha256(p) != entry["sha256"]:
            raise UserError(f"{p}: checksum mismatch (truncated or corrupted shard); rebuild the cache")
    elif verify and p.stat().st_size != entry["bytes"]:
        raise UserError(f"{p}: {p.stat().st_size} bytes, {mpath.name} records {entry['bytes']} (truncated or corrupted "
                        "shard: checksum not matched); rebuild the cache")


class FeatureDataset(torch.utils.data.Dataset):
    """Samples of an offline feature cache (memory-mapped), checked against the expected target identity.

    ``expect``: what the cache must match (``target``, ``tap_layers``, ``data``); ``data`` is compared only where
    the manifest records it (caches written by :func:`write_features` without it, as a library, are not keyed by
    their data). ``verify``: ``size`` (each shard's size and header against its manifest), ``sha256`` (every byte)
    or False."""

    def __init__(self, split_dir: str | Path, expect: dict | None = None, verify: str | bool = "size"):
        from safetensors import safe_open

        d = Path(split_dir)
        self.index: list[tuple[int, int]] = []
        self.files = []
        for mpath, m in read_manifests(d):
            self.tap_layers = m.get("tap_layers")
            keys = [k for k in (expect or {}) if k != "data" or "data" in m]
            got = {k: m.get(k) for k in keys}
            want = {k: (expect or {})[k] for k in keys}
            if expect is not None and got != want:
                k = next(k for k in ("target", "tap_layers", "data", *keys) if got.get(k) != want.get(k))
                what = _diff(got.get(k), want.get(k)) if k == "data" else f"{k}={got.get(k)}, but this run uses {want.get(k)}"
                raise UserError(f"{mpath}: feature cache was built for {what}; rebuild it with `python -m data.features` "
                                "or point data.feature_dir elsewhere")
            for s in m["shards"]:
                p = d / s["file"]
                check_shard(p, s, mpath, verify)
                try:
                    f = safe_open(str(p), framework="pt")
                    offsets = f.get_tensor("offsets")
                except Exception as e:  # safetensors raises its own error types on a damaged header
                    raise UserError(f"{p}: unreadable shard ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                                    "rebuild the cache") from None
                if len(offsets) != s["samples"] + 1 or int(offsets[-1]) != s["tokens"]:
                    raise UserError(f"{p}: holds {len(offsets) - 1} samples / {int(offsets[-1])} tokens, {mpath.name} records "
                                    f"{s['samples']} / {s['tokens']}; rebuild the cache")
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


def _diff(got: Any, want: Any) -> str:
    """``data.max_length=384, but this run uses 512`` for the first data setting that differs."""
    got, want = got or {}, want or {}
    k = next((k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)), None)
    return f"data.{k}={got.get(k)!r}, but this run uses {want.get(k)!r}"


def cache_state(split_dir: Path, expect: dict, world_size: int) -> str | None:
    """None where the split is a complete cache of ``world_size`` ranks matching ``expect``; else why not (a line)."""
    try:
        ds = FeatureDataset(split_dir, expect)
    except UserError as e:
        return str(e)
    del ds
    manifests = read_manifests(split_dir)
    worlds = {int(m.get("world_size", 1)) for _, m in manifests}
    if worlds != {world_size}:
        return f"{split_dir}: written by {sorted(worlds)} processes, this run has {world_size}"
    if "data" in expect and any(m.get("data") != expect["data"] for _, m in manifests):
        return f"{split_dir}: written from other data settings ({_diff(manifests[0][1].get('data'), expect['data'])})"
    return None


def feature_device(device: str | None) -> str:
    """A feature writer's device: under torchrun (``LOCAL_RANK`` set) ``cuda:LOCAL_RANK`` where GPUs are visible, else
    the CPU; otherwise ``device`` (auto: the first GPU when one is visible, else the CPU)."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None and (device in (None, "auto")):
        return f"cuda:{int(local)}" if torch.cuda.is_available() else "cpu"
    return device or "auto"


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    """Write the offline feature cache for the train and held-out splits of a training config (each split kept where it
    is complete and matches, rewritten where not)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    target = build_target(cfg, feature_device(cfg.get("device")))
    dm = instantiate(cfg.data, tokenizer=cfg.target.name_or_path)
    if cfg.data.feature_dir is not None and not isinstance(cfg.data.feature_dir, str):
        raise UserError(f"data.feature_dir={list(cfg.data.feature_dir)}: `python -m data.features` writes one cache; "
                        "give one directory (training reads a list)")
    out = Path(cfg.data.feature_dir or f"runs/features/{cfg.name}")
    guard_out(out, "data.feature_dir", ("train", "heldout"), overwrite=bool(cfg.get("overwrite")), what="a feature cache of ours")
    w = cfg.get("features_writer") or {}
    for split in ("train", "heldout"):
        key = dm.data_key(split)
        why = cache_state(out / split, {**identity_of(target), "data": key}, world)
        if why is None:
            print(f"{split}: {out / split} is up to date (same target, taps, data and {world} rank(s)); kept")
            continue
        if (out / split).exists() and any((out / split).iterdir()) and rank == 0:
            print(f"{split}: rewriting {out / split} ({why.split(': ', 1)[-1]})")
        stats = write_features(target, dm.split(split), out / split, batch_size=w.get("batch_size", 8),
                               shard_samples=w.get("shard_samples", 256), dtype=w.get("dtype", "bfloat16"),
                               rank=rank, world_size=world, data=key, progress=True)
        print(f"{split}: {stats['samples']} samples, {stats['tokens']:,} tokens, {stats['bytes'] / 2**20:.1f} MiB, "
              f"{stats['bytes_per_token']:.0f} bytes/token (rank {rank}/{world}, {target.device}) -> {out / split}")


if __name__ == "__main__":
    run_main(main)
