"""The training pipeline on a tiny target: run + export, online = offline loss, resume after SIGKILL, 2-process DDP, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, compose_train, train_overrides
from data.errors import UserError


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_train_exports_a_loadable_draft(tiny_target_dir, tiny_chats, tmp_path):
    from models.formats import load_draft
    from models.target import FrozenTarget
    from train.__main__ import run

    result = run(compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=4)))
    assert result["global_step"] == 4 and 1.0 <= result["val/acc_len"] <= 4.0
    assert (tmp_path / "run/checkpoints/last.ckpt").exists() and (tmp_path / "run/checkpoints/best.ckpt").exists()
    assert "draft:" in (tmp_path / "run/config.yaml").read_text()
    head = load_draft(tmp_path / "run/draft", FrozenTarget(str(tiny_target_dir)))
    assert json.loads((tmp_path / "run/draft/train_config.json").read_text())["trainer"]["max_steps"] == 4
    assert head.num_steps == 3
    # checkpoints leave the frozen target out
    state = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    assert state and not any(k.startswith("target.") for k in state)


def test_online_and_offline_give_the_same_loss(tiny_target_dir, tiny_chats, tmp_path):
    from data.features import FeatureDataset, identity_of, write_features
    from train.build import build
    from train.module import DraftModule

    cfg = compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run"))
    target, head, dm = build(cfg)
    ds = dm.split("train")
    stats = write_features(target, ds, tmp_path / "feat/train", batch_size=3, shard_samples=7, dtype="float32")
    assert stats["samples"] == len(ds) and stats["bytes_per_token"] > 4 * 32 * 3
    feats = FeatureDataset(tmp_path / "feat/train", identity_of(target))
    from data.datamodule import collate

    rows = [ds[i] for i in range(4)]
    online, offline = collate(rows), collate([feats[i] for i in range(4)])
    assert torch.equal(online["input_ids"], offline["input_ids"]) and torch.equal(online["loss_mask"], offline["loss_mask"])
    module = DraftModule(target, head)
    a, b = module._step(online), module._step(offline)
    assert torch.allclose(a.loss, b.loss, atol=1e-5) and torch.equal(a.correct, b.correct)
    # bf16 cache: close, not identical
    write_features(target, ds, tmp_path / "feat16/train", dtype="bfloat16")
    c = module._step(collate([FeatureDataset(tmp_path / "feat16/train")[i] for i in range(4)]))
    assert torch.allclose(a.loss, c.loss, rtol=0.05)


def test_offline_cache_bad_inputs(tiny_target_dir, tiny_chats, tmp_path):
    from data.features import FeatureDataset, identity_of, write_features
    from train.build import build

    cfg = compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run"))
    target, _, dm = build(cfg)
    d = tmp_path / "feat/train"
    write_features(target, dm.split("train"), d, shard_samples=8)
    ident = identity_of(target)
    with pytest.raises(UserError, match="tap_layers"):
        FeatureDataset(d, {**ident, "tap_layers": [0, 2]})
    with pytest.raises(UserError, match="target="):
        FeatureDataset(d, {**ident, "target": {**ident["target"], "hidden_size": 64}})
    shard = sorted(d.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    with pytest.raises(UserError, match="checksum"):
        FeatureDataset(d, ident)
    with pytest.raises(UserError, match="no feature cache"):
        FeatureDataset(tmp_path / "empty", ident)


def test_a_head_that_reads_no_taps_takes_any_cache_of_its_target(tiny_target_dir, tiny_chats, tmp_path):
    """A cache written for EAGLE-3's taps trains the EAGLE-1 head (it reads the final-norm feature only), and an
    export that recorded other taps starts it; EAGLE-3 itself still refuses a cache of other taps."""
    from data.features import write_features
    from train.__main__ import init_from_export
    from train.build import build

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run")
    target, eagle3, dm = build(compose_train(over + ["target.tap_layers=[0,1]"]))
    for split in ("train", "heldout"):
        write_features(target, dm.split(split), tmp_path / "feat" / split)
    eagle3.export(tmp_path / "eagle3")
    base = [o for o in over if not o.startswith("draft.")] + ["draft=eagle", f"data.feature_dir={tmp_path / 'feat'}", "features=offline"]
    _, eagle, dm = build(compose_train(base))
    dm.setup()
    assert len(dm._train) == len(dm.split("train")) and eagle.tap_layers != [0, 1]
    eagle.export(tmp_path / "eagle")
    target.set_tap_layers([0, 1])
    init_from_export(eagle, str(tmp_path / "eagle"), target)  # recorded taps differ from this run's: nothing read
    _, _, dm3 = build(compose_train(over + [f"data.feature_dir={tmp_path / 'feat'}", "features=offline"]))
    with pytest.raises(UserError, match="tap_layers"):
        dm3.setup()
    # caches of other taps do not mix (their rows would not stack in one batch), even for a head that reads none
    target.set_tap_layers([2])
    for split in ("train", "heldout"):
        write_features(target, dm.split(split), tmp_path / "feat2" / split)
    _, _, mixed = build(compose_train(base[:-2] + [f"data.feature_dir=[{tmp_path / 'feat'},{tmp_path / 'feat2'}]", "features=offline"]))
    with pytest.raises(UserError, match=r"different tap layers .*feat/train: \[0, 1\], .*feat2/train: \[2\]"):
        mixed.setup()


def test_offline_training_reads_several_caches(tiny_target_dir, tiny_chats, tmp_path):
    """data.feature_dir may list caches (trained on together, draft vocabulary counted over all of them);
    data.val_feature_dir picks the held-out caches."""
    from data.datamodule import DraftDataModule
    from data.features import identity_of, write_features
    from train.build import build

    cfg = compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run"))
    target, _, dm = build(cfg)
    train, held = dm.split("train"), dm.split("heldout")
    for name, rows in (("a", range(0, 5)), ("b", range(5, len(train)))):
        write_features(target, train.select(rows), tmp_path / name / "train", shard_samples=3)
        write_features(target, held, tmp_path / name / "heldout")
    write_features(target, held.select([0]), tmp_path / "c" / "heldout")
    ident = identity_of(target)
    both = DraftDataModule(tokenizer=str(tiny_target_dir), features="offline", feature_dir=[str(tmp_path / "a"), str(tmp_path / "b")],
                           val_feature_dir=str(tmp_path / "c"))
    both.expect_identity = ident
    both.setup()
    assert len(both._train) == len(train) and len(both._val) == 1
    assert [both._train[i]["input_ids"].tolist() for i in range(len(train))] == [list(r) for r in train["input_ids"]]
    online = DraftDataModule(tokenizer=str(tiny_target_dir), source=dm.source, heldout_fraction=dm.heldout_fraction,
                             max_length=dm.max_length, truncation=dm.truncation, val_conversations=dm.val_conversations)
    assert torch.equal(both.token_counts(), online.token_counts())
    one = DraftDataModule(tokenizer=str(tiny_target_dir), features="offline", feature_dir=str(tmp_path / "a"))
    one.setup()
    assert len(one._train) == 5 and len(one._val) == len(held)


def test_init_from_starts_a_run_from_an_export(tiny_target_dir, tiny_chats, tmp_path):
    """init_from=<export>: the new run's head starts with the export's weights and draft vocabulary (not the data's
    counts), trains on; a different family or draft shape gets one line naming init_from."""
    from train.__main__ import init_from_export, run
    from train.build import build

    first = run(compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "a", steps=2) + ["draft.draft_vocab_size=40"]))
    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "b", steps=2) + ["draft.draft_vocab_size=40"]
    target, head, _ = build(compose_train(over))
    from models.formats import load_draft

    src = load_draft(first["export"], target)
    assert not torch.equal(head.fc.weight, src.fc.weight)
    head.d2t.zero_()
    init_from_export(head, first["export"], target)
    for k, v in src.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), k
    second = run(compose_train(over + [f"init_from={first['export']}"]))
    assert second["global_step"] == 2 and torch.equal(load_draft(second["export"], target).d2t, src.d2t)
    # shipping the continued run reports the run it started from (train.ship)
    from train.ship import ship

    report = ship(tmp_path / "b", tmp_path / "shipped")
    assert report["started_from"]["init_from"] == first["export"]
    assert [r["step"] for r in report["started_from"]["validation_curve"]] == [1]
    assert report["training"]["train_tokens_including_init"] == first["train_tokens"] + second["train_tokens"]
    # a third stage from the shipped folder sums all three (as the SmolLM2 head's stages do)
    third = run(compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "c", steps=2)
                              + ["draft.draft_vocab_size=40", f"init_from={tmp_path / 'shipped'}"]))
    chained = ship(tmp_path / "c", tmp_path / "shipped2")
    assert chained["started_from"]["started_from"]["init_from"] == first["export"]
    assert chained["training"]["train_tokens_including_init"] == sum(r["train_tokens"] for r in (first, second, third))
    _, other, _ = build(compose_train(over[:-1] + ["draft.draft_vocab_size=30"]))
    with pytest.raises(UserError, match="init_from=.*does not fit this draft config"):
        init_from_export(other, first["export"], target)
    _, medusa, _ = build(compose_train([o for o in over if not o.startswith("draft.")] + ["draft=medusa"]))
    with pytest.raises(UserError, match="init_from=.*eagle3 draft, but this run trains medusa"):
        init_from_export(medusa, first["export"], target)
    # MTP's draft vocabulary only changes decoding: an export without one starts a run that chose its own
    plain = [o for o in over if not o.startswith("draft.")] + ["draft=mtp"]
    _, mtp, _ = build(compose_train(plain))
    mtp.export(tmp_path / "mtp")
    _, small, _ = build(compose_train(plain + ["draft.draft_vocab_size=30"]))
    small.prepare_from_data(torch.arange(float(small.t2d.numel())))  # this run's counts: the 30 highest ids
    init_from_export(small, str(tmp_path / "mtp"), target)
    assert int(small.draft_ids().min()) == small.t2d.numel() - 30
    assert all(torch.equal(small.state_dict()[k], v) for k, v in mtp.state_dict().items())
    # so does the floor's frozen head (the target's rows): a trained floor drafts from fewer rows unchanged; a
    # trainable head of another size (EAGLE-3 above) does not fit
    floor = [o for o in over if not o.startswith("draft.")] + ["draft=eagle"]
    _, full, _ = build(compose_train(floor))
    full.export(tmp_path / "floor")
    _, fewer, _ = build(compose_train(floor + ["draft.draft_vocab_size=30"]))
    fewer.prepare_from_data(torch.arange(float(fewer.t2d.numel())))
    init_from_export(fewer, str(tmp_path / "floor"), target)
    ids = fewer.draft_ids()
    assert int(ids.min()) == fewer.t2d.numel() - 30 and fewer.t2d.sum() == 30
    assert torch.equal(fewer.lm_head.weight, target.lm_head().weight[ids])
    assert all(torch.equal(fewer.state_dict()[k], v) for k, v in full.state_dict().items() if k not in fewer.vocab_state)


def test_time_budget_stops_on_the_clock_and_schedules_by_it(tiny_target_dir, tiny_chats, tmp_path):
    """time_budget_s: the run stops once its training wall time reaches the budget (trainer.max_steps far away),
    and the learning rate follows the share of the budget spent."""
    from train.__main__ import run
    from train.schedule import warmup_cosine_by

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=100000) + ["time_budget_s=4"]
    result = run(compose_train(over))
    assert 1 <= result["global_step"] < 100000 and 4 <= result["train_time_s"] < 60
    clock = {"p": 0.0}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine_by(opt, lambda: clock["p"], warmup=0.1, min_ratio=0.0)
    lrs = []
    for p in (0.05, 0.1, 0.55, 1.0, 2.0):
        clock["p"] = p
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-6)
    with pytest.raises(UserError, match="time_budget_s=-1"):
        run(compose_train(over[:-1] + ["time_budget_s=-1"]))


def test_stop_at_s_ends_the_process_early_and_a_resume_finishes_the_budget(tiny_target_dir, tiny_chats, tmp_path):
    """stop_at_s: this process stops after that much training time (summed over resumes) while the schedule stays
    time_budget_s'; ckpt_path=last continues to the full budget."""
    from train.__main__ import run

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=100000) + ["time_budget_s=5"]
    first = run(compose_train(over + ["stop_at_s=2"]))
    assert 2 <= first["train_time_s"] < 5
    second = run(compose_train(over + ["ckpt_path=last"]))
    assert second["global_step"] > first["global_step"] and 5 <= second["train_time_s"] < 60
    with pytest.raises(UserError, match="stop_at_s=0"):
        run(compose_train(over + ["stop_at_s=0"]))


def run_cli(args, timeout=240, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.mark.slow
def test_resume_after_sigkill(tiny_target_dir, tiny_chats, tmp_path):
    run_dir = tmp_path / "run"
    args = train_overrides(tiny_target_dir, tiny_chats, run_dir, steps=400) + ["trainer.val_check_interval=3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = run_dir / "checkpoints/last.ckpt"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if last.exists() and torch.load(last, weights_only=False)["global_step"] >= 6:
            break
        time.sleep(0.5)
    assert proc.poll() is None, f"training ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(last, weights_only=False)["global_step"]
    assert 6 <= killed_at < 400
    r = run_cli(args[:-1] + ["trainer.max_steps=" + str(killed_at + 6), "trainer.val_check_interval=3", "ckpt_path=last"])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout[r.stdout.index("{\n"):r.stdout.rindex("}") + 1])
    assert result["global_step"] == killed_at + 6
    assert f"resuming from step {killed_at}" in r.stdout


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tiny_target_dir, tiny_chats, tmp_path):
    args = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run", steps=3) + [
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32",
        "trainer.enable_progress_bar=false", "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1"]
    r = run_cli(args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world_size=2" in r.stdout + r.stderr or "GLOBAL_RANK: 1" in r.stdout + r.stderr
    assert (tmp_path / "run/draft/model.safetensors").exists()


@pytest.mark.parametrize("extra,expect", [
    (["target.tap_layers=[1,9]"], "out of range"),
    (["draft.num_heads=3"], "num_heads"),
    (["ckpt_path=/nonexistent/x.ckpt"], "ckpt_path"),
    (["draft.ttt_steps=0"], "ttt_steps"),
    (["features=offline", "data.feature_dir=/nonexistent/features"], "no feature cache"),
    (["init_from=/nonexistent/draft"], "/nonexistent/draft"),
])
def test_bad_input_one_line(tiny_target_dir, tiny_chats, tmp_path, extra, expect):
    r = run_cli(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run") + extra)
    assert r.returncode == 2, r.stderr[-2000:]
    errs = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errs) == 1 and expect in errs[0] and "Traceback" not in r.stderr


def test_unknown_config_key_is_refused(tiny_target_dir, tiny_chats, tmp_path):
    r = run_cli(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run") + ["draft.no_such_key=1"])
    assert r.returncode != 0 and "no_such_key" in r.stderr and "Traceback" not in r.stderr


def test_training_benchmark_writes_json(tiny_target_dir, tiny_chats, tmp_path):
    from eval.bench_train import bench

    over = train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run") + ["+bench.steps=1", "+bench.warmup=0", "+bench.precisions=[32]"]
    r = bench(compose_train(over))
    p = r["precisions"]["32"]
    assert r["cache_bytes_per_token"] > 0 and p["online_tokens_per_s"] > 0 and p["offline_tokens_per_s"] > 0
    assert p["head_step_over_target_forward"] > 0 and r["trainable_params"] > 0
