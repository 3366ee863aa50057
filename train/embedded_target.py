"""Recipe for the embedded target: a BPE tokenizer and a small Llama chat LM trained from scratch on ShareGPT.

    python -m train.embedded_target                       # full recipe (hours on a 2-core CPU)
    python -m train.embedded_target ckpt_path=last        # resume the run in run_dir
    python -m train.embedded_target experiment=micro ...  # seconds; used by the tests

Conversations are rendered with the chat template and packed into one token stream separated by
``<|endoftext|>``; training samples random windows of ``seq_len + 1`` tokens (nanoGPT style) and the
loss covers every token. The result is exported in Hugging Face format (bf16 safetensors) with its
tokenizer and a ``report.json`` (parameters, tokens seen, wall time, held-out loss, perplexity, bits
per byte) to ``export_dir``.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data.chat import tokenize_conversation
from data.conversations import load_conversations
from data.errors import UserError, atomic_dir, cli, run_main
from data.tokenizer import conversation_texts, train_tokenizer
from train.build import resolve_ckpt
from train.schedule import warmup_cosine

PACK_DTYPE = np.uint16  # vocabularies up to 65,536


def build_stream(ds, tokenizer, path: Path, num_proc: int = 1) -> np.ndarray:
    """Tokenise a conversation dataset (Arrow-cached `map`) and pack it into one uint16 stream on disk."""
    if path.exists():
        return np.load(path, mmap_mode="r")
    sep = tokenizer.pad_token_id

    def encode(batch):
        out = []
        for msgs in batch["messages"]:
            enc = tokenize_conversation(tokenizer, msgs)
            out.append((enc["input_ids"] if enc else []) + [sep])
        return {"ids": out}

    enc = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc, desc=f"tokenise {path.stem}")
    arr = np.fromiter((t for row in enc["ids"] for t in row), dtype=PACK_DTYPE)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


class WindowDataset(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` tokens: random (seeded by index, so resumable) or consecutive."""

    def __init__(self, stream: np.ndarray, seq_len: int, length: int, random: bool, seed: int = 0, offset: int = 0):
        self.stream, self.seq_len, self.length, self.random, self.seed, self.offset = stream, seq_len, length, random, seed, offset
        if len(stream) < seq_len + 2:
            raise UserError(f"token stream of {len(stream)} tokens is shorter than seq_len={seq_len}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.random:
            start = int(np.random.default_rng((self.seed, self.offset + i)).integers(0, len(self.stream) - self.seq_len - 1))
        else:
            start = (i * self.seq_len) % (len(self.stream) - self.seq_len - 1)
        return torch.from_numpy(self.stream[start: start + self.seq_len + 1].astype(np.int64))


class CausalLMModule(L.LightningModule):
    """Next-token training of a Hugging Face causal LM built from a config (random init)."""

    def __init__(self, model_config: dict, lr: float, weight_decay: float, warmup_steps: int, min_lr_ratio: float,
                 compile: bool, betas: tuple[float, float] = (0.9, 0.95)):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig(**model_config))
        # kept out of the module tree so checkpoints hold one copy of the weights
        object.__setattr__(self, "_fwd", torch.compile(self.model) if compile else self.model)
        self.tokens_seen = 0
        self._t0, self._wall_before = time.time(), 0.0  # wall time of earlier (resumed) segments

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]  # [B, T]
        logits = self._fwd(input_ids=x).logits  # [B, T, V]
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.tokens_seen += batch[:, 1:].numel()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", float(self.tokens_seen), prog_bar=False)
        return loss

    def validation_step(self, batch: torch.Tensor, _: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def wall_time(self) -> float:
        """Seconds spent on this run, over every resumed segment (up to the checkpoints kept)."""
        return self._wall_before + time.time() - self._t0

    def on_save_checkpoint(self, ckpt: dict) -> None:
        ckpt["tokens_seen"] = self.tokens_seen
        ckpt["wall_time"] = self.wall_time()

    def on_load_checkpoint(self, ckpt: dict) -> None:
        self.tokens_seen = ckpt.get("tokens_seen", 0)
        self._t0, self._wall_before = time.time(), float(ckpt.get("wall_time", 0.0))

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=hp.lr, betas=tuple(hp.betas))
        total = self.trainer.max_steps
        sched = warmup_cosine(opt, hp.warmup_steps, total, hp.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PackedDataModule(L.LightningDataModule):
    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, batch_size: int, val_batches: int, seed: int):
        super().__init__()
        self.train, self.val, self.seq_len, self.batch_size, self.val_batches, self.seed = train, val, seq_len, batch_size, val_batches, seed

    def train_dataloader(self):
        steps = self.trainer.max_steps
        done = self.trainer.global_step  # restored before the loader is built, so a resumed run sees new windows
        ds = WindowDataset(self.train, self.seq_len, (steps - done) * self.batch_size, True, self.seed, done * self.batch_size)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def val_dataloader(self):
        n = min(self.val_batches * self.batch_size, max(1, (len(self.val) - 1) // self.seq_len - 1))
        ds = WindowDataset(self.val, self.seq_len, n, False)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=False)


def bytes_per_token(stream: np.ndarray, tokenizer, limit: int = 2_000_000) -> float:
    """UTF-8 bytes per token of a packed stream (separators included as tokens, not bytes)."""
    ids = np.asarray(stream[:limit]).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return len(text.encode("utf-8")) / max(1, len(ids))


def prepare(cfg: DictConfig, run_dir: Path):
    """Conversations → tokenizer (trained once per run dir) → packed train/held-out streams."""
    from transformers import AutoTokenizer

    d = cfg.data
    train_ds = load_conversations(d.source, "train", d.heldout_fraction)
    val_ds = load_conversations(d.source, "heldout", d.heldout_fraction)
    if d.max_conversations:
        train_ds = train_ds.select(range(min(d.max_conversations, len(train_ds))))
        val_ds = val_ds.select(range(min(max(1, d.max_conversations // 10), len(val_ds))))
    tok_dir = Path(cfg.tokenizer.path) if cfg.tokenizer.get("path") else run_dir / "tokenizer"
    if cfg.tokenizer.get("path") and not (tok_dir / "tokenizer.json").exists():
        raise UserError(f"tokenizer.path={tok_dir}: no tokenizer.json there")
    if not (tok_dir / "tokenizer.json").exists():
        tok = train_tokenizer(conversation_texts(train_ds), cfg.tokenizer.vocab_size, cfg.tokenizer.max_chars)
        with atomic_dir(tok_dir) as tmp:
            tok.save_pretrained(str(tmp))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    train = build_stream(train_ds, tok, run_dir / "tokens_train.npy", d.num_proc)
    val = build_stream(val_ds, tok, run_dir / "tokens_heldout.npy", d.num_proc)
    print(f"tokens: train {len(train):,}  held-out {len(val):,}  (vocab {len(tok)})")
    return tok, train, val


def export(module: CausalLMModule, tok, export_dir: Path, report: dict) -> None:
    """Write the trained model in Hugging Face format (bf16 safetensors) atomically, with tokenizer and report."""
    from transformers import GenerationConfig

    model = module.model
    model.config.bos_token_id = None
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.mask_token_id = tok.convert_tokens_to_ids("<|mask|>")
    with atomic_dir(export_dir) as tmp:
        model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        model.float()
        GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id,
                         do_sample=False).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def evaluate_heldout(module: CausalLMModule, val: np.ndarray, seq_len: int, batch_size: int, max_batches: int) -> float:
    """Mean next-token loss (nats) over consecutive held-out windows, in fp32."""
    ds = WindowDataset(val, seq_len, min(max_batches * batch_size, max(1, (len(val) - 1) // seq_len - 1)), False)
    losses = []
    module.eval()
    with torch.no_grad():
        for b in torch.utils.data.DataLoader(ds, batch_size=batch_size):
            losses.append(module._loss(b).item())
    return float(np.mean(losses))


def run(cfg: DictConfig) -> dict:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    L.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision("high")
    tok, train, val = prepare(cfg, run_dir)
    model_cfg = {**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                 "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    module = CausalLMModule(model_cfg, **cfg.optim, compile=cfg.compile)
    dm = PackedDataModule(train, val, cfg.seq_len, cfg.batch_size, cfg.val_batches, cfg.seed)
    ckpt_dir = run_dir / "checkpoints"
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0,
                                                     train_time_interval=__import__("datetime").timedelta(minutes=cfg.checkpoint_minutes)),
                 L.pytorch.callbacks.LearningRateMonitor("step")]
    trainer = L.Trainer(**cfg.trainer, callbacks=callbacks, default_root_dir=str(run_dir),
                        logger=L.pytorch.loggers.CSVLogger(str(run_dir), name="logs"))
    ckpt_path = resolve_ckpt(cfg.ckpt_path, ckpt_dir)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    wall = module.wall_time()
    val_loss = evaluate_heldout(module, val, cfg.seq_len, cfg.batch_size, cfg.final_val_batches)
    bpt = bytes_per_token(val, tok)
    n_params = sum(p.numel() for p in module.model.parameters())
    report = {
        "parameters": n_params,
        "architecture": "LlamaForCausalLM",
        "config": {k: module.model.config.to_dict()[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                                   "num_key_value_heads", "intermediate_size", "vocab_size")},
        "train_tokens_seen": int(module.tokens_seen),
        "train_stream_tokens": int(len(train)),
        "heldout_stream_tokens": int(len(val)),
        "steps": int(trainer.global_step),
        "wall_time_s": round(wall, 1),
        "heldout_loss": round(val_loss, 4),
        "heldout_perplexity": round(math.exp(val_loss), 2),
        "heldout_bytes_per_token": round(bpt, 3),
        "heldout_bits_per_byte": round(val_loss / math.log(2) / bpt, 4),
        "precision": str(cfg.trainer.precision),
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
    }
    print(json.dumps(report, indent=2))
    if cfg.export_dir:
        export(module, tok, Path(cfg.export_dir), report)
        print(f"exported to {cfg.export_dir}")
    return report


@hydra.main(config_path="../conf", config_name="embedded_target", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    run_main(main)
