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

from data.errors import atomic_file, cli, write_json
from train.build import build, instantiate, resolve_ckpt


def run(cfg: DictConfig) -> dict:
    from train.module import DraftModule

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    target, head, dm = build(cfg)
    ckpt_dir = run_dir / "checkpoints"
    ckpt = resolve_ckpt(cfg.ckpt_path, ckpt_dir)
    if ckpt is None:
        head.prepare_from_data(dm.token_counts())
    else:
        print(f"resuming from step {torch.load(ckpt, map_location='cpu', weights_only=False)['global_step']} ({ckpt})")
    module = DraftModule(target, head, **cfg.optim)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # the resolved config at the run's root: inside checkpoints/ it made Lightning warn "exists and is not empty"
    with atomic_file(run_dir / "config.yaml") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    callbacks = [instantiate(c) for c in cfg.callbacks.values()] if cfg.get("callbacks") else []
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, default_root_dir=str(run_dir))
    trainer.fit(module, dm, ckpt_path=ckpt)
    best = next((c.best_model_path for c in callbacks if isinstance(c, L.pytorch.callbacks.ModelCheckpoint) and c.best_model_path), "")
    if best and cfg.export_best:
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state, strict=False)
    result = {"run_dir": str(run_dir), "global_step": trainer.global_step, "best_checkpoint": best,
              "train_time_s": round(module.train_time_s, 1),
              "trainable_params": sum(p.numel() for p in head.parameters() if p.requires_grad),
              "train_tokens": module.train_tokens,
              **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}}
    if trainer.is_global_zero:
        out = head.export(run_dir / "draft", train_config=resolved)
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
    main()
