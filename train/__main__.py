"""``python -m train``: train a draft head on a frozen target (Hydra + Lightning).

    python -m train                                   # EAGLE-3 on the embedded target, ShareGPT, CPU
    python -m train experiment=eagle3_quick           # an experiment overrides only what differs
    python -m train ckpt_path=last                    # resume the run in run_dir
    python -m train features=offline                  # train from `python -m data.features` shards
    python -m train -m draft.ttt_steps=3,7            # a small sweep (multirun)

Every object comes from config by ``_target_``: target (``conf/target``), head (``conf/draft``, built
with ``target=``), data (``conf/data``), trainer (``conf/trainer``), logger (``conf/logger``). At the end
the best checkpoint (by validation expected acceptance length) is exported to ``run_dir/draft``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, atomic_file, cli, run_main, write_json
from train.build import build, instantiate, resolve_ckpt
from train.distributed import export_head, full_parameters
from train.rundir import RunLock, join_run_lock, sweep_leftovers


def run(cfg: DictConfig) -> dict:
    run_dir = Path(cfg.run_dir)
    rank = int(os.environ.get("RANK", 0)) or int(os.environ.get("LOCAL_RANK", 0))
    if rank:
        join_run_lock(run_dir, rank)  # the other ranks of a multi-process run: rank 0 of this launch holds the lock
        return _run(cfg, run_dir)
    with RunLock(run_dir):
        sweep_leftovers(run_dir)
        return _run(cfg, run_dir)


def read_checkpoint(path: str) -> dict:
    """A training checkpoint, or one UserError naming the file (truncated, not a checkpoint, not ours)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, random bytes, a directory, ...
        raise UserError(f"ckpt_path={path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'damaged'})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict) or "global_step" not in ckpt:
        raise UserError(f"ckpt_path={path}: not a Lightning training checkpoint (no state_dict / global_step)")
    return ckpt


def check_checkpoint(ckpt: dict, path: str, module: Any) -> None:
    """Refuse a checkpoint of another draft (family, class, shapes) before anything is written."""
    mine = {"family": module.head.family, "class": f"{type(module.head).__module__}.{type(module.head).__qualname__}"}
    theirs = ckpt.get("draft") or {}
    if theirs and theirs.get("class") != mine["class"]:
        raise UserError(f"ckpt_path={path}: a checkpoint of a {theirs.get('family')} draft ({theirs.get('class')}), "
                        f"but this run trains {mine['family']} ({mine['class']})")
    want = {k: v for k, v in module.state_dict().items() if not k.startswith("target.")}
    have = ckpt["state_dict"]
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise UserError(f"ckpt_path={path}: does not fit this draft ({mine['family']}): missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in want.items():
        if tuple(have[k].shape) != tuple(v.shape):
            raise UserError(f"ckpt_path={path}: {k} has shape {tuple(have[k].shape)} in the checkpoint, {tuple(v.shape)} in this "
                            f"draft (a different draft config)")


def init_from_export(head: Any, path: str, target: Any) -> None:
    """Start ``head`` from an exported draft's weights and draft vocabulary (``init_from=``): the same family, tap
    layers (where the head reads them) and tensor shapes, or one UserError naming what differs. The new run's own
    schedule and data follow."""
    from models.formats import load_draft

    taps = list(target.tap_layers)
    src = load_draft(path, target)  # sets the target's taps to the export's; checked against this run's below
    target.set_tap_layers(taps)
    if type(src) is not type(head):
        raise UserError(f"init_from={path}: a {src.family} draft, but this run trains {head.family} (choose draft={src.family} "
                        "or another export)")
    if head.reads_taps and list(src.tap_layers) != taps:  # a head that reads no taps only records them
        raise UserError(f"init_from={path}: trained on tap layers {src.tap_layers}, this run taps {taps} (set "
                        f"target.tap_layers={src.tap_layers})")
    mine, theirs = head.state_dict(), src.state_dict()
    vocab = [k for k in head.vocab_state if k in mine and k in src.vocab_state]
    # a vocabulary over the target's frozen rows (MTP's, the floor's): this run's where the export's is missing or
    # of another size, all of it (its d2t, t2d and rows belong together); an equal one is the export's
    own = vocab if any(k not in theirs or theirs[k].shape != mine[k].shape for k in vocab) else []
    theirs = {k: v for k, v in theirs.items() if k not in own}
    bad = [k for k in mine if k not in own and (k not in theirs or theirs[k].shape != mine[k].shape)]
    if bad:
        raise UserError(f"init_from={path}: does not fit this draft config: {bad[0]} "
                        f"{tuple(theirs[bad[0]].shape) if bad[0] in theirs else 'missing'} vs {tuple(mine[bad[0]].shape)} "
                        "(use the draft settings it was trained with)")
    head.load_state_dict(theirs, strict=not own)
    print(f"initialised from {path} ({'its weights; the draft vocabulary from this run' if own else 'its weights and draft vocabulary'})")


def check_lengths(cfg: DictConfig, target: Any, dm: Any) -> None:
    """Training sequences must fit the target's positions: refuse a longer data.max_length; cap a null one."""
    n = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return
    if dm.max_length is None:
        print(f"note: data.max_length=null: sequences are cut at the target's max_position_embeddings={n}")
        dm.max_length = n
    elif dm.max_length > n:
        raise UserError(f"data.max_length={dm.max_length} exceeds the target's max_position_embeddings={n}: "
                        f"set data.max_length<={n}")


# what a resumed run may change: its length, when it stops, validates, logs and checkpoints (and where it lives)
RESUMABLE = ("name", "run_dir", "ckpt_path", "overwrite", "stop_at_step", "stop_at_s", "time_budget_s", "export_best",
             "logger", "callbacks", "trainer.max_steps", "trainer.max_epochs", "trainer.val_check_interval",
             "trainer.check_val_every_n_epoch", "trainer.limit_val_batches", "trainer.log_every_n_steps",
             "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.num_sanity_val_steps",
             "data.num_workers", "target.fast_linear")
FINISHED = ("result.json", "draft", "checkpoints/best.ckpt", "checkpoints/last.ckpt")  # what a started run leaves


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_values(cfg: DictConfig) -> None:
    """Values read before anything is built or written, each a one-line UserError: ``seed`` an integer >= 0,
    ``stop_at_step`` null or >= 1, ``stop_at_s`` null or > 0, ``draft.draft_vocab_size`` null or >= 1."""
    if not _int(cfg.seed) or cfg.seed < 0:
        raise UserError(f"seed={cfg.seed}: an integer >= 0")
    step = cfg.get("stop_at_step")
    if step is not None and (not _int(step) or step < 1):
        raise UserError(f"stop_at_step={step}: the global step after which this process stops, an integer >= 1 (or null)")
    secs = cfg.get("stop_at_s")
    if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs <= 0):
        raise UserError(f"stop_at_s={secs}: seconds of training after which this process stops, a number > 0")
    vocab = (cfg.get("draft") or {}).get("draft_vocab_size")
    if vocab is not None and (not _int(vocab) or vocab < 1):
        raise UserError(f"draft.draft_vocab_size={vocab}: the number of target tokens the head drafts, an integer >= 1 "
                        "(null: the whole vocabulary)")


def flatten(d: Any, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def check_resume(old: dict, new: dict, path: str) -> None:
    """A resumed run continues the one in the checkpoint: what it was trained with (the draft and its shapes, the
    target and its taps, the data, the optimiser and its learning-rate schedule, the seed) cannot change, or the
    export would be labelled with settings its weights never saw. A learning rate or schedule change is refused,
    not applied: the optimiser and scheduler come back from the checkpoint. What may change is in RESUMABLE."""
    a, b = flatten(old), flatten(new)

    def free(k: str) -> bool:
        return any(k == r or k.startswith(r + ".") for r in RESUMABLE)

    # a key only one side has is a setting added or removed since: its default keeps the old behaviour
    changed = [k for k in sorted(set(a) & set(b)) if not free(k) and a[k] != b[k]]
    if changed:
        what = "; ".join(f"{k}={a[k]} there, {b[k]} here" for k in changed[:3])
        raise UserError(f"ckpt_path={path}: the checkpoint's run was trained with other settings ({what}"
                        f"{'; ...' if len(changed) > 3 else ''}); resume with its settings, or start a new run "
                        "(another name=, or init_from=<its export>)")


def recorded_config(state: dict, ckpt: str, ckpt_dir: Path, run_dir: Path) -> dict | None:
    """The config a checkpoint was trained with: the one it records, or (a checkpoint of this run written before
    checkpoints recorded it) the run's config.yaml; None when neither is known."""
    if isinstance(state.get("run_config"), dict):
        return state["run_config"]
    if Path(ckpt).resolve().parent == ckpt_dir.resolve() and (run_dir / "config.yaml").exists():
        return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)
    return None


def check_fresh_start(cfg: DictConfig, run_dir: Path) -> None:
    """Training from scratch into a folder that holds a run would replace its checkpoints and export: refused,
    unless ``overwrite=true`` (the old run's checkpoints, export, result and logs are then removed first)."""
    held = [f for f in FINISHED if (run_dir / f).exists()]
    if not held:
        return
    if not cfg.get("overwrite"):
        why = "; checkpoints/last.ckpt is missing" if cfg.get("ckpt_path") == "last" else ""
        raise UserError(f"run_dir={run_dir}: holds a run ({', '.join(held)}){why}; resume it with ckpt_path=last, "
                        "choose another name=, or pass overwrite=true to train it again from scratch")
    import shutil

    if int(os.environ.get("LOCAL_RANK", 0)) or int(os.environ.get("RANK", 0)):
        return  # rank 0 clears
    for name in ("checkpoints", "draft", "logs", "result.json"):
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    print(f"note: overwrite=true: removed the previous run in {run_dir}")


def _run(cfg: DictConfig, run_dir: Path) -> dict:
    from models.heads.vocab import vocab_coverage
    from train.callbacks import RecordConfig, StopAtStep, TimeBudget
    from train.module import DraftModule

    check_values(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    target, head, dm = build(cfg)
    check_lengths(cfg, target, dm)
    ckpt_dir = run_dir / "checkpoints"
    ckpt = resolve_ckpt(cfg.ckpt_path, ckpt_dir)
    module = DraftModule(target, head, time_budget_s=cfg.get("time_budget_s"), **cfg.optim)
    if ckpt is None:
        counts = dm.token_counts()
        head.prepare_from_data(counts)
        if getattr(head, "draft_vocab_size", None) and hasattr(head, "draft_ids"):
            print(vocab_coverage(counts, head.draft_ids()))
        if cfg.get("init_from"):  # its weights and draft vocabulary (a head whose vocabulary only drafts: this run's)
            init_from_export(head, str(cfg.init_from), target)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if ckpt is None:
        check_fresh_start(cfg, run_dir)
    else:
        state = read_checkpoint(ckpt)
        check_checkpoint(state, ckpt, module)
        old = recorded_config(state, ckpt, ckpt_dir, run_dir)
        if old is None:
            print(f"note: {ckpt} records no config: its settings cannot be checked against this run's")
        else:
            check_resume(old, resolved, ckpt)
        print(f"resuming from step {state['global_step']} ({ckpt})")
        del state
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # the resolved config at the run's root: inside checkpoints/ it made Lightning warn "exists and is not empty"
    with atomic_file(run_dir / "config.yaml") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    callbacks = [instantiate(c) for c in cfg.callbacks.values()] if cfg.get("callbacks") else []
    callbacks.append(RecordConfig(resolved))
    if cfg.get("stop_at_step"):
        callbacks.append(StopAtStep(cfg.stop_at_step))
    if cfg.get("time_budget_s"):
        callbacks.append(TimeBudget(cfg.time_budget_s))
    if cfg.get("stop_at_s") is not None:
        callbacks.append(TimeBudget(cfg.stop_at_s))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, default_root_dir=str(run_dir))
    trainer.fit(module, dm, ckpt_path=ckpt)
    best = next((c.best_model_path for c in callbacks if isinstance(c, L.pytorch.callbacks.ModelCheckpoint) and c.best_model_path), "")
    with full_parameters(trainer.strategy.model, writeback=True):  # FSDP: the full head on every rank (all ranks enter)
        if best and cfg.export_best:
            state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
            module.load_state_dict(state, strict=False)
        out = export_head(head, run_dir / "draft", resolved, trainer.is_global_zero)
    val = {**module.loaded_val_metrics,  # a resumed run that validates no more keeps the checkpoint's
           **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}}
    result = {"run_dir": str(run_dir), "global_step": trainer.global_step, "best_checkpoint": best,
              "train_time_s": round(module.train_time_s, 1),
              "trainable_params": sum(p.numel() for p in head.parameters() if p.requires_grad),
              "train_tokens": module.train_tokens, "train_positions": module.train_positions, **val}
    if trainer.is_global_zero:
        result["export"] = str(out)
        write_json(run_dir / "result.json", result)
        print(json.dumps(result, indent=2))
    return result


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@cli
def main(cfg: DictConfig) -> float | None:
    result = run(cfg)
    return result.get("val/acc_len")


if __name__ == "__main__":
    run_main(main)
