"""Training callbacks: ``last.ckpt`` is the last step (always), a run can stop at a step and resume exactly, and a
time budget ends a run on the clock.

``best.ckpt`` stays with Lightning's ``ModelCheckpoint`` (``monitor: val/acc_len``, ``save_last: false``);
:class:`LastCheckpoint` writes ``last.ckpt`` after every validation, every ``every_n_train_steps`` steps
and when training ends, atomically (a temporary sibling renamed over it, so a kill -9 mid-write leaves the
previous one). It subclasses ``Checkpoint`` so Lightning runs it after ``ModelCheckpoint``: the state it
saves already knows the best checkpoint of this validation.
"""
from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint


class LastCheckpoint(Checkpoint):
    def __init__(self, dirpath: str, filename: str = "last.ckpt", every_n_train_steps: int = 0):
        self.dirpath, self.filename, self.every_n_train_steps = Path(dirpath), filename, int(every_n_train_steps)
        self._saved_step = -1

    @property
    def path(self) -> Path:
        return self.dirpath / self.filename

    def save(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or trainer.global_step == self._saved_step:
            return
        tmp = self.dirpath / f".{self.filename}.tmp-{os.getpid()}"
        trainer.save_checkpoint(str(tmp))
        if trainer.is_global_zero:
            os.replace(tmp, self.path)
        trainer.strategy.barrier("last_checkpoint")
        self._saved_step = trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """The logger's step counter as a resumed run needs it. Lightning counts a batch for the loggers only after
        its validation, and a checkpoint written there (a completed batch) is restored as if written after the count:
        a run resumed from it logged every step one lower than an uninterrupted run (Lightning 2.6)."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        done, state = loop.get("epoch_loop.batch_progress", {}).get("total", {}), loop.get("epoch_loop.state_dict")
        if state is not None and done and done.get("completed") == done.get("processed") and trainer.accumulate_grad_batches == 1:
            state["_batches_that_stepped"] = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        n = self.every_n_train_steps
        if n > 0 and trainer.global_step % n == 0:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)


class StopAtStep(L.Callback):
    """Stop this process after global step ``step`` while keeping the schedule of ``trainer.max_steps``
    (``python -m train stop_at_step=N``; continue later with ``ckpt_path=last``)."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class TimeBudget(L.Callback):
    """Stop once the run's training wall time (summed over resumes, ``DraftModule.train_time_s``) reaches
    ``seconds``: ``python -m train time_budget_s=3600`` (the learning-rate schedule runs on the same clock), or
    ``stop_at_s=900`` (this process stops early, the schedule stays time_budget_s'; continue with ckpt_path=last)."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if pl_module.train_time_s >= self.seconds:
            trainer.should_stop = True
