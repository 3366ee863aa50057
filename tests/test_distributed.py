"""Multi-process training on CPUs (gloo, 2 processes): FSDP units really shard and the gathered export equals the
unsharded head; a DDP run stopped and resumed has the loss curve and weights of an uninterrupted one; every rank
restores its own RNG; ranks > 0 join rank 0's run lock and refuse another run's.

Lightning's FSDP (trainer=fsdp) runs only on GPUs (torch's FSDP1 refuses CPUs); the sharding is tested here through
torch's ``fully_shard`` on the same units (train.distributed.wrap_units)."""
from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_model, train_overrides

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _then_exit(rank: int, fn, *args) -> None:
    """Run one worker, then leave without the interpreter's teardown: gloo's worker threads can still hold work
    objects at finalization and abort the process (SIGABRT) after the worker has finished and written its report."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_then_exit, args=(fn, 2, free_port(), *args), nprocs=2, join=True)


def init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


# -- FSDP units ------------------------------------------------------------------------------------
def test_decoder_layer_class_is_read_from_the_target():
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.distributed import decoder_layer_class

    for folder, name in (("llama-3.1-8b-instruct", "LlamaDecoderLayer"), ("qwen3-8b", "Qwen3DecoderLayer")):
        cfg = AutoConfig.from_pretrained(ROOT / "tests/fixtures/configs" / folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert decoder_layer_class(model).__name__ == name


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from models.heads.eagle3 import Eagle3Head
    from models.target import FrozenTarget
    from train.distributed import export_head, fully_shard_units, wrap_units

    init(rank, world, port)
    target = FrozenTarget(model=tiny_model("llama"), dtype="float32", fast_linear=False)
    torch.manual_seed(0)
    head = Eagle3Head(target, ttt_steps=2, draft_vocab_size=64)
    with torch.no_grad():  # a head that differs from its initialisation everywhere
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    if rank == 0:
        head.export(Path(out) / "unsharded")
    units = wrap_units(target, head)

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.target, self.head = target, head

        def forward(self, x):
            return x

    fully_shard_units(target, head, Root())
    report = {"units": len(units), "params": []}
    for unit in units:
        for name, p in unit.named_parameters():
            assert isinstance(p, DTensor), name
            report["params"].append([p.numel(), p.to_local().numel()])
    export_head(head, Path(out) / "sharded", None, rank_zero=rank == 0)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_shards_each_unit_and_export_gathers_the_full_head(tmp_path):
    from safetensors.torch import load_file

    spawn(_fsdp_worker, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["units"] == 4 + 1  # the tiny target's 4 decoder layers and the head
    for r in reports:  # each rank holds about half of every parameter (dim 0 split in two), not all of it
        for total, local in r["params"]:
            assert local <= -(-total // 2) + 1e-9 and (total < 2 or local < total)
    held = [sum(local for _, local in r["params"]) for r in reports]
    assert sum(held) == sum(total for total, _ in reports[0]["params"])  # the shards partition the units
    a, b = load_file(str(tmp_path / "unsharded/model.safetensors")), load_file(str(tmp_path / "sharded/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((tmp_path / "sharded/config.json").read_text()) == json.loads((tmp_path / "unsharded/config.json").read_text())


def test_fsdp_on_cpu_is_one_line(tiny_target_dir, tiny_chats, tmp_path):
    out = subprocess.run([PY, "-m", "train", *train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run"),
                          "target.fast_linear=false", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: trainer=fsdp runs on GPUs only")
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1] == errors[0]


# -- RNG per rank ----------------------------------------------------------------------------------
def _rng_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from train.distributed import rng_state_of_this_rank, rng_states_of_all_ranks
    from train.module import rng_states, set_rng_states

    init(rank, world, port)
    torch.manual_seed(100 + rank)
    ckpt = {"rng_states": rng_states()}
    ckpt["rng_states_per_rank"] = rng_states_of_all_ranks(ckpt["rng_states"])
    expected = torch.rand(4)
    torch.manual_seed(7)  # what a restarted process has before the checkpoint is applied
    set_rng_states(rng_state_of_this_rank(ckpt))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"expected": expected.tolist(), "got": torch.rand(4).tolist(),
                                                           "ranks": len(ckpt["rng_states_per_rank"])}))
    dist.destroy_process_group()


def test_every_rank_restores_its_own_rng(tmp_path):
    spawn(_rng_worker, str(tmp_path))
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert r[0]["ranks"] == r[1]["ranks"] == 2
    for x in r:
        assert x["got"] == x["expected"]
    assert r[0]["got"] != r[1]["got"]  # the ranks' streams differ: rank 0's would not do for rank 1


# -- DDP resume ------------------------------------------------------------------------------------
def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of every logged step, later runs' logs over earlier ones."""
    out: dict[int, float] = {}
    for f in sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        for row in csv.DictReader(f.open()):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def test_ddp_stopped_and_resumed_equals_uninterrupted(tiny_target_dir, tiny_chats, tmp_path, monkeypatch):
    """2 CPU processes: stop at step 3, resume to 8 (crossing an epoch mid-way) == straight to 8: the loss curve step
    by step and the exported weights. Rank 1 joins rank 0's lock in each of the three launches."""
    from safetensors.torch import load_file

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))

    def launch(run: str, *more: str) -> None:
        o = train_overrides(tiny_target_dir, tiny_chats, tmp_path / run, steps=8)
        out = subprocess.run([PY, "-m", "train", *o, "target.fast_linear=false", "trainer=ddp", "trainer.accelerator=cpu",
                              "trainer.devices=2", *more], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]

    launch("straight")
    launch("resumed", "stop_at_step=3")
    assert torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)["global_step"] == 3
    assert not (tmp_path / "resumed/.lock").exists()  # released by rank 0, not left by rank 1
    launch("resumed", "ckpt_path=last")
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == list(range(8))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    wa = load_file(str(tmp_path / "straight/draft/model.safetensors"))
    wb = load_file(str(tmp_path / "resumed/draft/model.safetensors"))
    assert max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].is_floating_point()) < 1e-6
    ckpt = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)
    assert len(ckpt["rng_states_per_rank"]) == 2


# -- the run lock on ranks > 0 ---------------------------------------------------------------------
def write_lock(run_dir: Path, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "started": "now", "launch": None, **holder}))


def test_rank_joins_the_lock_of_its_launch(tmp_path, monkeypatch):
    from train.rundir import join_run_lock

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    write_lock(tmp_path / "a", pid=os.getppid())  # Lightning's launcher: rank 0 is the parent of ranks > 0
    assert join_run_lock(tmp_path / "a", rank=1, timeout_s=2)["pid"] == os.getppid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")  # torchrun: the ranks share the run id
    write_lock(tmp_path / "b", pid=1, launch="torchrun:launch-1")
    assert join_run_lock(tmp_path / "b", rank=3, timeout_s=2)["launch"] == "torchrun:launch-1"


def test_rank_waits_for_rank_zero(tmp_path, monkeypatch):
    import threading

    from train.rundir import RunLock, join_run_lock

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")
    lock = RunLock(tmp_path)
    timer = threading.Timer(0.5, lock.acquire)  # rank 0 takes it a moment after rank 1 starts looking
    timer.start()
    t0 = time.monotonic()
    try:
        assert join_run_lock(tmp_path, rank=1, timeout_s=10)["pid"] == os.getpid()
        assert time.monotonic() - t0 >= 0.4
    finally:
        timer.join()
        lock.release()


def test_rank_refuses_another_runs_lock(tmp_path, monkeypatch):
    from data.errors import UserError
    from train.rundir import join_run_lock

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-3")
    other = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        write_lock(tmp_path / "a", pid=other.pid, launch="torchrun:another")
        with pytest.raises(UserError, match="not by rank 0 of this launch"):
            join_run_lock(tmp_path / "a", rank=1, timeout_s=2)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        write_lock(tmp_path / "b", pid=other.pid)  # a plain run whose process is not our parent
        with pytest.raises(UserError, match=f"in use by pid {other.pid}"):
            join_run_lock(tmp_path / "b", rank=1, timeout_s=2)
    finally:
        other.kill()
        other.wait()
    with pytest.raises(UserError, match="found no lock"):
        join_run_lock(tmp_path / "none", rank=1, timeout_s=0.5)


def test_fsdp_config_wraps_decoder_layers_and_the_head(tmp_path):
    """conf/trainer/fsdp.yaml builds the draft strategy; its policy, resolved from the module, names the target's
    decoder-layer class and the head's class (nothing else is a unit: the rest is the root)."""
    from hydra import compose, initialize_config_dir

    from data.errors import instantiate
    from models.heads.eagle3 import Eagle3Head
    from models.target import FrozenTarget
    from train.distributed import DraftFSDPStrategy

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["trainer=fsdp", f"run_dir={tmp_path}"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, DraftFSDPStrategy) and strategy.kwargs["use_orig_params"] is True
    assert "auto_wrap_policy" not in strategy.kwargs  # resolved from the target when the model is set up
    target = FrozenTarget(model=tiny_model("qwen3"), dtype="float32", fast_linear=False)
    head = Eagle3Head(target, ttt_steps=2, draft_vocab_size=64)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.target, self.head = target, head

    seen = {}

    def fake_setup(self, model):  # Lightning's wrapping (GPUs only) replaced by recording the policy it would get
        seen["policy"] = self.kwargs["auto_wrap_policy"]
        return model

    parent = DraftFSDPStrategy.__mro__[1]
    original = parent._setup_model
    parent._setup_model = fake_setup
    try:
        strategy._setup_model(Module())
    finally:
        parent._setup_model = original
    names = {c.__name__ for c in seen["policy"]._module_classes}
    assert names == {"Qwen3DecoderLayer", "Eagle3Head"}
