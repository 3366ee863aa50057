"""Build the objects of a training run from a composed config (``python -m train``, ``eval.bench_train``, tests).

``instantiate`` lives on the ground floor (:mod:`data.errors`) and ``build_target`` with the feature writer
(:mod:`data.features`); both are re-exported here for the callers that build a whole run."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from data.errors import UserError, instantiate
from data.features import build_target, identity_of

__all__ = ["build", "build_target", "instantiate", "resolve_ckpt"]


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Target, head and datamodule from a composed config (the head sees the training data's token counts)."""
    target = build_target(cfg)
    head = instantiate(cfg.draft, target=target)
    dm = instantiate(cfg.data, tokenizer=cfg.target.name_or_path)
    dm.expect_identity = identity_of(target, taps=head.reads_taps)
    return target, head, dm


def resolve_ckpt(ckpt_path: str | None, ckpt_dir: Path) -> str | None:
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        p = ckpt_dir / "last.ckpt"
        if not p.exists():
            print(f"no checkpoint at {p}; starting from scratch")
            return None
        return str(p)
    if not os.path.exists(ckpt_path):
        raise UserError(f"ckpt_path={ckpt_path}: no such checkpoint (use 'last' or a path to a .ckpt file)")
    return ckpt_path
