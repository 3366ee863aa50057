"""One LightningModule for every draft head: features, optimisation, logging, validation that predicts decoding.

The head owns its forward and loss (:class:`models.heads.base.DraftHead`); this module owns AdamW, the
warm-up + cosine schedule (over steps, or over a time budget's seconds), the frozen target, and the validation metrics: per-step top-1 accuracy
``acc_j`` (step j = the j-th drafted token) and the expected acceptance length
``1 + Σ_k Π_{j<=k} acc_j`` (``val/acc_len``), on which checkpoints are selected; for heads trained against the
target's distribution also the T=1 acceptance ``accept_t1_j`` (mean Σ_v min(p, q)) and its ``val/acc_len_t1``.
"""
from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from models.layers import expected_acceptance_length
from models.target import TargetOutput
from train.distributed import rng_state_of_this_rank, rng_states_of_all_ranks
from train.schedule import warmup_cosine, warmup_cosine_by


class DraftModule(L.LightningModule):
    def __init__(self, target: Any, head: Any, lr: float = 3e-4, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_ratio: float = 0.04, min_lr_ratio: float = 0.0,
                 time_budget_s: float | None = None):
        super().__init__()
        if time_budget_s is not None and (not isinstance(time_budget_s, (int, float)) or not 0 < time_budget_s < float("inf")):
            from data.errors import UserError

            raise UserError(f"time_budget_s={time_budget_s}: seconds of training, a number > 0 (or null for a step budget)")
        self.time_budget_s = time_budget_s  # the schedule runs on the share of it spent (train.callbacks.TimeBudget stops)
        check_optim(lr, weight_decay, betas, warmup_ratio, min_lr_ratio)
        self.target, self.head = target, head
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_ratio, self.min_lr_ratio = warmup_ratio, min_lr_ratio
        self.strict_loading = False  # checkpoints leave out the frozen target
        self._val_correct = self._val_total = self._val_accepted = None
        self._time_before, self._t0 = 0.0, None  # training wall time of earlier (resumed) runs, start of this one
        self.train_tokens = 0  # non-padding tokens seen by training steps (this rank), kept in checkpoints
        self.train_positions = 0  # positions of those batches, padding included: tokens / positions is the batches' fill
        self.loaded_val_metrics: dict[str, float] = {}  # the last validation's val/* of the checkpoint resumed from
        self._rng_to_restore = None  # RNG states of the checkpoint, applied when training (re)starts

    @property
    def train_time_s(self) -> float:
        """Wall time spent in fit, summed over resumed runs (kept in the checkpoints)."""
        return self._time_before + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def on_train_start(self) -> None:
        self._t0 = time.perf_counter()
        if self._rng_to_restore is not None:  # after the sanity check, which may draw random numbers
            set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    # -- features -------------------------------------------------------------------------------
    def features(self, batch: dict[str, torch.Tensor]) -> TargetOutput:
        """Target features for a batch: from the batch (offline cache) or from the frozen target (online). The
        target's logits are left to the head: made from the final state at the rows its loss reads."""
        if "tap_states" in batch:
            return TargetOutput(tap_states=batch["tap_states"].float(), last_state=batch["last_state"].float(),
                                lm_head=self.target.model.lm_head)
        with torch.no_grad():
            return self.target(batch["input_ids"], attention_mask=batch["attention_mask"])

    def _step(self, batch: dict[str, torch.Tensor]):
        return self.head.training_loss(batch, self.features(batch))

    # -- loops ----------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        out = self._step(batch)
        acc = out.correct / out.total.clamp_min(1)
        self.log("train/loss", out.loss, prog_bar=True)
        self.log("train/acc_len", expected_acceptance_length(acc), prog_bar=True)
        if out.accepted is not None:
            self.log("train/acc_len_t1", expected_acceptance_length(out.accepted / out.total.clamp_min(1)))
        n = int(batch["attention_mask"].sum())
        self.train_tokens += n
        self.train_positions += batch["attention_mask"].numel()
        self.log("train/tokens", float(n), reduce_fx="sum")
        for k, v in out.metrics.items():
            self.log(f"train/{k}", v)
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self._val_correct = self._val_total = self._val_accepted = None

    def validation_step(self, batch: dict[str, torch.Tensor], _: int) -> None:
        out = self._step(batch)
        self.log("val/loss", out.loss, prog_bar=False, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        c, t = out.correct.detach(), out.total.detach()
        self._val_correct = c if self._val_correct is None else self._val_correct + c
        self._val_total = t if self._val_total is None else self._val_total + t
        if out.accepted is not None:
            a = out.accepted.detach()
            self._val_accepted = a if self._val_accepted is None else self._val_accepted + a

    def on_validation_epoch_end(self) -> None:
        if self._val_correct is None:
            return
        c, t = self._val_correct, self._val_total
        if self.trainer.world_size > 1:
            c, t = self.all_gather(c).sum(0), self.all_gather(t).sum(0)
        acc = c / t.clamp_min(1)
        for j, a in enumerate(acc.tolist()):
            self.log(f"val/acc_{j}", a, sync_dist=False)
        self.log("val/acc_len", expected_acceptance_length(acc), prog_bar=True, sync_dist=False)
        if self._val_accepted is not None:  # T=1: the chance exact rejection sampling keeps step j's sampled token
            a = self._val_accepted
            if self.trainer.world_size > 1:
                a = self.all_gather(a).sum(0)
            acc1 = a / t.clamp_min(1)
            for j, x in enumerate(acc1.tolist()):
                self.log(f"val/accept_t1_{j}", x, sync_dist=False)
            self.log("val/acc_len_t1", expected_acceptance_length(acc1), sync_dist=False)

    # -- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for p in self.head.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, betas=self.betas)
        if self.time_budget_s:
            sched = warmup_cosine_by(opt, lambda: self.train_time_s / self.time_budget_s, self.warmup_ratio, self.min_lr_ratio)
        else:
            total = self.trainer.estimated_stepping_batches
            sched = warmup_cosine(opt, int(self.warmup_ratio * total), total, self.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoints: the frozen target is not saved ---------------------------------------------
    def on_save_checkpoint(self, ckpt: dict) -> None:
        ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if not k.startswith("target.")}
        ckpt["train_time_s"], ckpt["train_tokens"] = self.train_time_s, self.train_tokens
        ckpt["train_positions"] = self.train_positions
        ckpt["draft"] = {"family": self.head.family, "class": f"{type(self.head).__module__}.{type(self.head).__qualname__}"}
        metrics = self.trainer.callback_metrics if self._trainer is not None else {}
        ckpt["val_metrics"] = {**self.loaded_val_metrics,
                               **{k: float(v) for k, v in metrics.items() if k.startswith("val/")}}
        ckpt["rng_states"] = rng_states()
        ckpt["rng_states_per_rank"] = rng_states_of_all_ranks(ckpt["rng_states"])  # Lightning writes rank 0's file only

    def on_load_checkpoint(self, ckpt: dict) -> None:
        self._time_before = float(ckpt.get("train_time_s", 0.0))
        self.train_tokens = int(ckpt.get("train_tokens", 0))
        self.train_positions = int(ckpt.get("train_positions", 0))
        self.loaded_val_metrics = dict(ckpt.get("val_metrics") or {})
        self._rng_to_restore = rng_state_of_this_rank(ckpt)


def rng_states() -> dict:
    """torch, numpy and Python RNG states as plain tensors/lists (loadable with ``weights_only=True``)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    v, internal, g = states["python"]
    random.setstate((v, tuple(internal), g))


def check_optim(lr: float, weight_decay: float, betas, warmup_ratio: float, min_lr_ratio: float) -> None:
    """One UserError naming the ``optim.*`` field whose value cannot train."""
    from data.errors import UserError

    def bad(field: str, value: Any, want: str) -> None:
        raise UserError(f"optim.{field}={value}: {want}")

    if not isinstance(lr, (int, float)) or not lr > 0 or lr != lr or lr == float("inf"):
        bad("lr", lr, "the learning rate must be a finite number > 0")
    if not isinstance(weight_decay, (int, float)) or not 0 <= weight_decay < float("inf"):
        bad("weight_decay", weight_decay, "must be >= 0")
    try:
        b = [float(x) for x in betas] if not isinstance(betas, (str, bytes)) else None
    except (TypeError, ValueError):
        b = None
    if b is None or len(b) != 2 or not all(0 <= x < 1 for x in b):
        bad("betas", betas, "must be two numbers in [0, 1)")
    if not isinstance(warmup_ratio, (int, float)) or not 0 <= warmup_ratio <= 1:
        bad("warmup_ratio", warmup_ratio, "must be in [0, 1]")
    if not isinstance(min_lr_ratio, (int, float)) or not 0 <= min_lr_ratio <= 1:
        bad("min_lr_ratio", min_lr_ratio, "must be in [0, 1]")
