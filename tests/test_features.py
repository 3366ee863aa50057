"""The offline feature cache (data/features.py): tapped by pre-hooks, keyed by what made it (target, taps, data, rank
layout), checked cheaply on open, rebuilt where damaged or stale, written by several ranks under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose_train, train_overrides
from data.errors import UserError


@pytest.fixture(scope="module")
def built(tiny_target_dir, tiny_chats, tmp_path_factory):
    from train.build import build

    cfg = compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path_factory.mktemp("run")))
    return build(cfg)


def write_split(target, dm, out: Path, split: str = "train", **kw) -> dict:
    from data.features import write_features

    return write_features(target, dm.split(split), out / split, data=dm.data_key(split), shard_samples=5, dtype="float32", **kw)


def test_cached_states_are_the_targets_own_and_the_cache_knows_its_data(built, tmp_path):
    from data.features import FeatureDataset, identity_of

    target, _, dm = built
    write_split(target, dm, tmp_path / "c")
    feats = FeatureDataset(tmp_path / "c/train", {**identity_of(target), "data": dm.data_key("train")})
    ds = dm.split("train")
    assert len(feats) == len(ds)
    row = ds[3]
    out = target(torch.tensor([row["input_ids"]]))
    # the same states (batched with padding in the writer: equal to rounding)
    assert torch.allclose(feats[3]["tap_states"], out.tap_states[0], atol=1e-5)
    assert torch.allclose(feats[3]["last_state"], out.last_state[0], atol=1e-5)
    manifest = json.loads((tmp_path / "c/train/manifest-r0.json").read_text())
    assert manifest["data"]["max_length"] == dm.max_length and manifest["data"]["split"] == "train"
    assert manifest["world_size"] == 1 and all(s["bytes"] > 0 for s in manifest["shards"])
    from data.errors import umask

    for shard in (tmp_path / "c/train").glob("shard-*.safetensors"):  # readable by others where the umask allows
        assert shard.stat().st_mode & 0o777 == 0o666 & ~umask()


def test_training_with_other_data_settings_does_not_read_an_old_cache(built, tmp_path):
    from data.datamodule import DraftDataModule
    from data.features import identity_of

    target, _, dm = built
    for split in ("train", "heldout"):
        write_split(target, dm, tmp_path / "c", split)
    same = dict(tokenizer=dm.tokenizer_name, source=dm.source, heldout_fraction=dm.heldout_fraction, truncation=dm.truncation,
                val_conversations=dm.val_conversations, features="offline", feature_dir=str(tmp_path / "c"))
    ok = DraftDataModule(max_length=dm.max_length, max_conversations=dm.max_conversations, **same)
    ok.expect_identity = identity_of(target)
    ok.setup()
    assert len(ok._train) == len(dm.split("train"))
    for change, msg in (({"max_length": 48}, f"data.max_length={dm.max_length}, but this run uses 48"),
                        ({"max_conversations": 7}, "data.conversations=None, but this run uses 7"),
                        ({"chat_template_kwargs": {"enable_thinking": False}},
                         "data.chat_template_kwargs=None, but this run uses {'enable_thinking': False}")):
        other = DraftDataModule(**{"max_length": dm.max_length, "max_conversations": dm.max_conversations, **change}, **same)
        other.expect_identity = identity_of(target)
        with pytest.raises(UserError, match=msg.replace("(", r"\(")):
            other.setup()
    moved = DraftDataModule(max_length=dm.max_length, **{**same, "source": str(tmp_path / "other.jsonl")})
    moved.expect_identity = identity_of(target)
    with pytest.raises(UserError, match="data.source="):
        moved.setup()


def test_a_later_run_with_fewer_ranks_adds_no_duplicates(built, tmp_path):
    """Two ranks write halves; a later one-rank run into the same directory removes rank 1's files, and a manifest of
    another layout left beside the cache is refused rather than read twice."""
    from data.features import FeatureDataset

    target, _, dm = built
    n = len(dm.split("train"))
    for rank in (0, 1):
        write_split(target, dm, tmp_path / "c", rank=rank, world_size=2)
    two = FeatureDataset(tmp_path / "c/train")
    assert len(two) == n and len(list((tmp_path / "c/train").glob("manifest-r*.json"))) == 2
    keep = (tmp_path / "c/train/manifest-r1.json").read_text()
    write_split(target, dm, tmp_path / "c", rank=0, world_size=1)
    assert sorted(p.name for p in (tmp_path / "c/train").glob("manifest-*")) == ["manifest-r0.json"]
    assert not list((tmp_path / "c/train").glob("shard-r1-*"))
    one = FeatureDataset(tmp_path / "c/train")
    assert len(one) == n
    assert sorted(one[i]["input_ids"].tolist() for i in range(n)) == sorted(two[i]["input_ids"].tolist() for i in range(n))
    (tmp_path / "c/train/manifest-r1.json").write_text(keep)  # a stale manifest of the 2-rank layout
    with pytest.raises(UserError, match=r"manifests of ranks \[0, 1\] written by runs of \[1, 2\] processes"):
        FeatureDataset(tmp_path / "c/train")


def test_damage_is_found_on_open_without_reading_every_byte(built, tmp_path):
    from data.features import FeatureDataset, cache_state, identity_of

    target, _, dm = built
    write_split(target, dm, tmp_path / "c")
    expect = {**identity_of(target), "data": dm.data_key("train")}
    assert cache_state(tmp_path / "c/train", expect, 1) is None
    assert "processes" in cache_state(tmp_path / "c/train", expect, 2)
    assert "max_length" in cache_state(tmp_path / "c/train", {**expect, "data": {**expect["data"], "max_length": 9}}, 1)
    shard = sorted((tmp_path / "c/train").glob("shard-*.safetensors"))[1]
    good = shard.read_bytes()
    shard.write_bytes(good[:-64])  # truncated
    with pytest.raises(UserError, match=rf"{shard.name}: {len(good) - 64} bytes, manifest-r0.json records {len(good)}"):
        FeatureDataset(tmp_path / "c/train")
    shard.write_bytes(b"\xff" * len(good))  # same size, header destroyed
    with pytest.raises(UserError, match="unreadable shard"):
        FeatureDataset(tmp_path / "c/train")
    assert cache_state(tmp_path / "c/train", expect, 1) is not None
    with pytest.raises(UserError, match="checksum mismatch"):
        FeatureDataset(tmp_path / "c/train", verify="sha256")


def run(args: list[str], cwd: Path = ROOT, torchrun: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    head = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}", "-m"] if torchrun else [sys.executable, "-m"]
    return subprocess.run(head + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_command_keeps_a_good_cache_and_rebuilds_a_damaged_one(tiny_target_dir, tiny_chats, tmp_path):
    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run") + ["features=offline", f"data.feature_dir={tmp_path / 'c'}",
                                                                             "features_writer.shard_samples=5", "device=cpu"]
    first = run(["data.features", *over])
    assert first.returncode == 0, first.stderr[-2000:]
    again = run(["data.features", *over])
    assert again.returncode == 0 and "train: " in again.stdout and "is up to date" in again.stdout, again.stdout
    shard = sorted((tmp_path / "c/train").glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    fixed = run(["data.features", *over])
    assert fixed.returncode == 0 and "train: rewriting" in fixed.stdout and "heldout: " in fixed.stdout, fixed.stdout
    from data.features import FeatureDataset

    assert len(FeatureDataset(tmp_path / "c/train")) > 0
    if not torch.cuda.is_available():
        bad = run(["data.features", *over[:-1], "device=cuda"])
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
            "error: device='cuda' but no GPU is visible; use device=cpu"], bad.stderr[-2000:]


def test_torchrun_ranks_share_the_samples(tiny_target_dir, tiny_chats, tmp_path):
    """Two CPU processes under torchrun write one cache: each its share, together every sample once, the same states
    as one process writes."""
    from data.features import FeatureDataset

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run") + ["features=offline", "features_writer.shard_samples=5",
                                                                             "features_writer.dtype=float32"]
    two = run(["data.features", *over, f"data.feature_dir={tmp_path / 'two'}"], torchrun=2)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    one = run(["data.features", *over, f"data.feature_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-2000:]
    for split in ("train", "heldout"):
        a, b = FeatureDataset(tmp_path / "one" / split), FeatureDataset(tmp_path / "two" / split)
        assert len(a) == len(b) and len(list((tmp_path / "two" / split).glob("manifest-r*.json"))) == 2
        rows_a = {tuple(a[i]["input_ids"].tolist()): a[i]["tap_states"] for i in range(len(a))}
        for i in range(len(b)):
            x = b[i]
            assert torch.allclose(rows_a[tuple(x["input_ids"].tolist())], x["tap_states"], atol=1e-5)
