"""Lightning datamodule for draft training: tokenised conversations (online features) or a feature cache (offline).

Online: batches hold ``input_ids``, ``loss_mask``, ``attention_mask`` [B, T] and the frozen target runs
inside the training step. Offline: batches also hold ``tap_states`` [B, T, n_taps, d] and
``last_state`` [B, T, d] read from the memory-mapped shards written by ``python -m data.features``.
"""
from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch

from data.errors import UserError
from data.features import FeatureDataset, collate

__all__ = ["DraftDataModule", "collate"]


def cache_dirs(value: str | list[str] | None) -> list[str]:
    """``data.feature_dir`` / ``data.val_feature_dir``: one cache directory or a list of them → a list."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, (str, Path)) else [str(v) for v in value]


class FeatureSet(torch.utils.data.ConcatDataset):
    """The same split of several feature caches, one after the other (each checked as :class:`FeatureDataset`)."""

    def __init__(self, split_dirs: list[Path], expect: dict | None = None):
        parts = [FeatureDataset(d, expect) for d in split_dirs]
        taps = {str(p.tap_layers) for p in parts}
        if len(taps) > 1:  # rows of one batch would not stack
            each = ", ".join(f"{d}: {p.tap_layers}" for d, p in zip(split_dirs, parts))
            raise UserError(f"data.feature_dir: these caches were written with different tap layers ({each}); "
                            "write every cache with the same target.tap_layers")
        super().__init__(parts)
        self.files = [f for p in parts for f in p.files]


class DraftDataModule(L.LightningDataModule):
    """Conversations → tokenised with the target's chat template → batches (online or offline features)."""

    def __init__(self, source: str | list[str] = "sharegpt", heldout_fraction: float = 0.02, max_length: int | None = 2048,
                 truncation: str = "turn", max_conversations: int | None = None, val_conversations: int | None = 64,
                 batch_size: int = 4, num_workers: int = 0, num_proc: int = 1, tokenizer: str = "embedded",
                 features: str = "online", feature_dir: str | list[str] | None = None,
                 val_feature_dir: str | list[str] | None = None, seed: int = 0, make: dict | None = None,
                 chat_template_kwargs: dict | None = None, hub_split: str = "train"):
        """``make``: how the file ``make["file"]`` is made where ``source`` names it (alone or in a list) and it is
        missing: the other keys are ``python -m data.regenerate``'s (the target's own answers;
        :func:`data.regenerate.make_source`), e.g. ``conf/data/embedded_sampled.yaml``. Any other missing file is an
        error, so a mistyped ``data.source`` never starts a regeneration. ``chat_template_kwargs`` go to the chat
        template (``{"enable_thinking": False}``); ``hub_split``: the split read from a Hugging Face dataset source."""
        super().__init__()
        if features not in ("online", "offline"):
            raise UserError(f"features={features!r}: use online or offline")
        if batch_size < 1:
            raise UserError(f"data.batch_size={batch_size}: must be >= 1")
        self.source, self.heldout_fraction, self.max_length, self.truncation = source, heldout_fraction, max_length, truncation
        self.max_conversations, self.val_conversations = max_conversations, val_conversations
        self.batch_size, self.num_workers, self.num_proc = batch_size, num_workers, num_proc
        self.tokenizer_name, self.features, self.seed = tokenizer, features, seed
        # offline: train on the train splits of one or several caches, validate on the held-out splits of
        # val_feature_dir (default: the same caches), e.g. original text for training, the target's own for validation
        self.feature_dirs, self.val_feature_dirs = cache_dirs(feature_dir), cache_dirs(val_feature_dir)
        self.make = dict(make) if make else None
        self.chat_template_kwargs, self.hub_split = dict(chat_template_kwargs or {}), hub_split
        self._train = self._val = None
        self._tok = None
        self.expect_identity: dict | None = None  # set by the trainer entry point: the target the cache must match

    @property
    def tokenizer(self):
        if self._tok is None:
            from models.target import load_tokenizer

            self._tok = load_tokenizer(self.tokenizer_name)
        return self._tok

    def split(self, name: str):
        """The tokenised split (``train`` or ``heldout``) as a ``datasets.Dataset`` (Arrow-cached)."""
        from data.prepare import tokenize_split

        self.make_source()
        limit = self.max_conversations if name == "train" else self.val_conversations
        return tokenize_split(self.tokenizer, self.source, name, self.heldout_fraction, self.max_length,
                              self.truncation, limit, self.num_proc, verbose=False,
                              chat_template_kwargs=self.chat_template_kwargs, hub_split=self.hub_split)

    def data_key(self, split: str) -> dict:
        """What made a split's samples, recorded by a feature cache and checked when training opens it: the
        source(s), how they are split, cut and counted (a cache of other settings holds other samples)."""
        src = [str(self.source)] if isinstance(self.source, (str, Path)) else [str(s) for s in self.source]
        key = {"source": src, "split": split, "heldout_fraction": self.heldout_fraction, "max_length": self.max_length,
               "truncation": self.truncation, "hub_split": self.hub_split,
               "conversations": self.max_conversations if split == "train" else self.val_conversations}
        if self.chat_template_kwargs:  # the chat template's arguments change the tokens
            key["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return key

    def make_source(self) -> None:
        """Regenerate ``make["file"]`` first if ``source`` names it and it is missing (once, on one process)."""
        if not self.make:
            return
        settings = dict(self.make)
        file = settings.pop("file", None)
        if not file:
            raise UserError("data.make: give file, the path it makes (the source it stands for), with data.regenerate's keys")
        sources = [self.source] if isinstance(self.source, (str, Path)) else list(self.source)
        if Path(file).exists() or not any(Path(str(s)) == Path(file) for s in sources):
            return
        from data.regenerate import make_source

        if self.chat_template_kwargs and "chat_template_kwargs" not in settings:  # answers made as the training data renders
            settings["chat_template_kwargs"] = self.chat_template_kwargs

        if int(os.environ.get("LOCAL_RANK", "0")) or int(os.environ.get("NODE_RANK", "0")):
            raise UserError(f"data.source: {file} is missing; make it on one process first (python -m train "
                            "on one device, or python -m data.regenerate with data.make's keys)")
        make_source(file, settings)

    def token_counts(self) -> torch.Tensor:
        """Counts [V] of loss-masked tokens in the training split (draft vocabularies are built from these); with
        offline features, of the caches' training splits (what the head trains on, however many caches)."""
        V = len(self.tokenizer)
        counts = torch.zeros(V, dtype=torch.long)
        if self.features == "offline":
            self.setup()  # opens (and checks) the caches once; training reuses them
            for f, _ in self._train.files:
                t = f.get_tensor("input_ids").long()[f.get_tensor("loss_mask").bool()]
                counts += torch.bincount(t, minlength=V)[:V]
            return counts
        ds = self.split("train")
        for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
            t = torch.as_tensor(ids)[torch.as_tensor(mask).bool()]
            counts += torch.bincount(t, minlength=V)[:V]
        return counts

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        if self.features == "offline":
            if not self.feature_dirs:
                raise UserError("features=offline needs data.feature_dir (write it with `python -m data.features`)")
            self._train = FeatureSet([Path(d) / "train" for d in self.feature_dirs], self._expect("train", self.feature_dirs))
            val_dirs = self.val_feature_dirs or self.feature_dirs
            self._val = FeatureSet([Path(d) / "heldout" for d in val_dirs], self._expect("heldout", val_dirs))
        else:
            self._train = self.split("train").with_format("python")
            self._val = self.split("heldout").with_format("python")

    def _expect(self, split: str, dirs: list[str]) -> dict | None:
        """What the caches of ``split`` must match: the target and taps (``expect_identity``) and, where this run
        reads one cache written by ``python -m data.features`` from its own data config, that data's settings (several
        caches are each written from their own data, so only their target and taps are checked)."""
        if self.expect_identity is None:
            return None
        if len(dirs) != 1 or (split == "heldout" and self.val_feature_dirs):
            return self.expect_identity
        return {**self.expect_identity, "data": self.data_key(split)}

    def _loader(self, ds, shuffle: bool) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(self.seed)  # its own generator: making an iterator draws no global random number
        pad = self.tokenizer.pad_token_id or 0
        if shuffle:
            rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
            sampler = EpochSampler(len(ds), self.seed, rank=rank, world_size=world)
            return ResumableLoader(ds, self._progress, batch_size=self.batch_size, sampler=sampler,
                                   generator=g, num_workers=self.num_workers, collate_fn=lambda rows: collate(rows, pad))
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, generator=g,
                                           num_workers=self.num_workers, collate_fn=lambda rows: collate(rows, pad))

    def _progress(self) -> tuple[int, int]:
        """(epoch, batches of it completed) as the trainer counts them (at a checkpoint: a step boundary)."""
        loop = self.trainer.fit_loop
        return loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.completed

    def train_dataloader(self):
        return self._loader(self._train, shuffle=True)

    def val_dataloader(self):
        return self._loader(self._val, shuffle=False)


class EpochSampler(torch.utils.data.distributed.DistributedSampler):
    """A shuffle whose order in epoch ``e`` depends on (seed, e) only, and that can start mid-epoch: the data
    position of a resumed run (Lightning sets the epoch; :class:`ResumableLoader` the batches to skip). With
    ``world_size`` > 1 rank r takes every world_size-th sample of that order from r (the order padded by its own
    head to a multiple of world_size, as torch's DistributedSampler does); being a DistributedSampler, Lightning
    keeps it instead of wrapping it in one whose position a checkpoint cannot restore."""

    def __init__(self, n: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        super().__init__(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.n, self.seed, self.epoch = n, seed, 0
        self.resume: tuple[int, int] | None = None  # (epoch, samples of this rank to skip in it), used once

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return -(-self.n // self.num_replicas)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        if self.num_replicas > 1:
            order = (order + order[:len(self) * self.num_replicas - self.n])[self.rank::self.num_replicas]
        skip = self.resume[1] if self.resume is not None and self.resume[0] == self.epoch else 0
        self.resume = None
        yield from order[skip:]


class ResumableLoader(torch.utils.data.DataLoader):
    """The training loader with Lightning's ``state_dict``/``load_state_dict`` interface: checkpoints record
    the epoch and the batches completed in it, and a resumed run continues with the next batch (no
    batch seen twice or skipped, the same order as an uninterrupted run), on every rank."""

    def __init__(self, dataset, progress, **kw):
        super().__init__(dataset, **kw)
        self._progress = progress

    def state_dict(self) -> dict:
        epoch, batches = self._progress()
        return {"epoch": int(epoch), "batches": int(batches), "batch_size": self.batch_size, "samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_size") != self.batch_size or state.get("samples") != len(self.dataset):
            print(f"note: the training data changed since the checkpoint (batch size {state.get('batch_size')} -> "
                  f"{self.batch_size}, samples {state.get('samples')} -> {len(self.dataset)}); the epoch restarts")
            return
        self.sampler.resume = (int(state["epoch"]), int(state["batches"]) * self.batch_size)
