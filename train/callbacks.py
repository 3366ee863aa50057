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
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from data.errors import public


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
            public(tmp)  # Lightning's save leaves it private (0600)
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


class AtomicModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (``best.ckpt``) written to a temporary sibling in the same folder and
    renamed over the final name, with the mode the umask allows. Lightning's own save writes a temporary file
    in the system's temp folder and moves it: a copy when that is another file system, so a full disk left a
    partial ``best.ckpt`` under its final name, and the file kept tempfile's private mode (0600)."""

    @property
    def state_key(self) -> str:
        """Lightning's key for ``ModelCheckpoint``: checkpoints of either class resume with their best score."""
        return super().state_key.replace(type(self).__qualname__, "ModelCheckpoint", 1)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        from weakref import proxy

        final = Path(filepath)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        trainer.save_checkpoint(str(tmp), self.save_weights_only)
        if trainer.is_global_zero:
            public(tmp)
            os.replace(tmp, final)
        trainer.strategy.barrier("best_checkpoint")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


class RecordConfig(L.Callback):
    """Keep the run's resolved config in every checkpoint (``checkpoint["run_config"]``): a resume checks it
    against its own config (``train.__main__.check_resume``)."""

    def __init__(self, config: dict):
        self.config = config

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.config
