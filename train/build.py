"""Build the objects of a training run from a composed config (shared by `python -m train` and `python -m data.features`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from data.errors import UserError


def instantiate(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets our one-line UserErrors through (Hydra wraps them) and names
    the config node when a constructor rejects its arguments."""
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, TypeError):
            raise UserError(f"{node.get('_target_')}: {cause}") from None
        raise


def build_target(cfg: DictConfig) -> Any:
    """The frozen target with the tap layers the head family wants (unless the config names them)."""
    from models.target import default_tap_layers

    target = instantiate(cfg.target, tap_layers=None)
    head_cls = hydra.utils.get_class(cfg.draft._target_)
    taps = cfg.target.tap_layers
    if taps is None:
        taps = default_tap_layers(target.num_layers, head_cls.tap_method, cfg.get("n_taps", 5))
    target.set_tap_layers(list(taps))
    return target


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Target, head and datamodule from a composed config (the head sees the training data's token counts)."""
    target = build_target(cfg)
    head = instantiate(cfg.draft, target=target)
    dm = instantiate(cfg.data, tokenizer=cfg.target.name_or_path)
    from data.features import identity_of

    dm.expect_identity = identity_of(target)
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
