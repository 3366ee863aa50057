"""A plan before launch: parameters, bytes per device, feature-cache size and time of a training run, from the target's
``config.json`` alone (``python -m eval.planner plan=true``).

The target and the draft head are built on the meta device (``with torch.device("meta")``: shapes, no storage, no
weights read), so an 8B target plans in about a second on any machine. What is counted per device:

- weights: the frozen target in its dtype; the draft's trainable parameters as an fp32 master copy plus a bf16 copy
  (mixed precision), its frozen ones that are not the target's own tensors (EAGLE-3's fp32 embedding copy) as built;
- gradients: fp32, trainable parameters only; optimiser: AdamW's two fp32 moments per trainable parameter;
- activations: an *estimate* from the draft's shapes (:func:`activation_values`), not a measurement;
- ``trainer=gpu|ddp`` replicate everything on every device; ``trainer=fsdp`` shards the target and the draft over
  the N devices (weights, gradients, optimiser state / N) and gathers one wrapped unit at a time (the largest unit's
  full weights in bf16 is added as the gather peak); activations are per device in both.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from data.errors import UserError

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
GIB = 1024 ** 3


def meta_models(cfg: Any) -> tuple[Any, Any]:
    """The frozen target (``cfg.target``, only its ``config.json`` read) and the head (``cfg.draft``) on the meta device."""
    import hydra
    from transformers import AutoConfig, AutoModelForCausalLM

    from data.errors import instantiate
    from models.target import FrozenTarget, default_tap_layers, resolve_path

    name = str(cfg.target.name_or_path)
    path = resolve_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"target.name_or_path={name}: no readable config.json ({str(e).splitlines()[0][:120]})") from None
    dtype = plan_dtype(str(cfg.target.get("dtype", "auto")))
    head_cls = hydra.utils.get_class(cfg.draft._target_)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        taps = cfg.target.get("tap_layers")
        if taps is None:
            taps = default_tap_layers(config.num_hidden_layers, head_cls.tap_method, cfg.get("n_taps", 5))
        target = FrozenTarget(name_or_path=name, model=model, tap_layers=list(taps), dtype="none", fast_linear=False,
                             device="meta")
        head = instantiate(cfg.draft, target=target)
    return target, head


def plan_dtype(dtype: str) -> torch.dtype:
    """The target's dtype on the training devices: ``auto`` is bfloat16 there (GPUs)."""
    from models.target import DTYPES

    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise UserError(f"target.dtype={dtype!r}: use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parameter_counts(target: Any, head: nn.Module) -> dict:
    """Target total; draft trainable and total (a frozen tensor the head shares with the target counts once, there)."""
    mine = {id(p) for p in target.parameters()}
    own = [p for p in head.parameters() if id(p) not in mine]
    return {"target": sum(p.numel() for p in target.parameters()),
            "draft_trainable": sum(p.numel() for p in own if p.requires_grad),
            "draft_frozen": sum(p.numel() for p in own if not p.requires_grad),
            "draft_total": sum(p.numel() for p in own),
            "draft_frozen_bytes": sum(p.numel() * p.element_size() for p in own if not p.requires_grad)}


def activation_values(target: Any, head: nn.Module, online: bool) -> dict:
    """Values kept for backward per draft row (a token position of one unrolled step) and per target token: an
    estimate from shapes, not a measurement.

    Per draft row: the inputs and outputs of every linear layer of the head (Σ in + out features; what autograd keeps
    for the matmuls, elementwise temporaries between them excluded), plus the log-softmax and the teacher's
    distribution over the draft vocabulary (2·Vd). Rows per sequence: T × ``ttt_steps`` for heads that unroll their
    layers (EAGLE, EAGLE-3), ``num_anchors`` × ``block_size`` for block heads (DFlash, DSpark), else T (MTP's and
    Medusa's layers each run once per token, and all of them are in the sum). Per target token: online, the hidden
    states the target returns (L+1)·d in its dtype and the teacher logits over the full vocabulary (fp32); offline,
    the cached taps and last state (n_taps·d + d, fp32 after loading). Attention scores are not counted (fused SDPA
    keeps none)."""
    linear = sum(m.in_features + m.out_features for m in head.modules() if isinstance(m, nn.Linear))
    vd = int(getattr(head, "draft_vocab_size", None) or target.vocab_size)
    c = target.config
    d, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    if online:
        per_token = {"bytes": (L + 1) * d * BYTES.get(target.model.dtype, 4) + (V * 4 if head.needs_teacher_logits else 0)}
    else:
        per_token = {"bytes": (len(target.tap_layers) + 1) * d * 4}
    return {"per_row_values": linear + 2 * vd, "per_target_token_bytes": per_token["bytes"]}


def draft_rows(head: nn.Module, seq_len: int) -> int:
    """Draft rows per sequence of ``seq_len`` tokens (see :func:`activation_values`)."""
    if hasattr(head, "num_anchors") and hasattr(head, "block_size"):
        return int(head.num_anchors) * int(head.block_size)
    return seq_len * int(getattr(head, "ttt_steps", 1) or 1)


def largest_unit(target: Any, head: nn.Module) -> int:
    """Parameters of the largest unit FSDP gathers at once (a target decoder layer or the whole head)."""
    from train.distributed import decoder_layer_class

    cls = decoder_layer_class(target.model)
    layers = [m for m in target.model.modules() if isinstance(m, cls)] if cls is not None else []
    unit = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return max(unit, trainable)


def memory(target: Any, head: nn.Module, devices: int, batch_size: int, seq_len: int, online: bool = True) -> dict:
    """Bytes per device, replicated (gpu/ddp) and sharded over ``devices`` (fsdp)."""
    n = parameter_counts(target, head)
    tb = BYTES.get(target.model.dtype, 4)
    act = activation_values(target, head, online)
    rows = batch_size * draft_rows(head, seq_len)
    parts = {"target_weights": n["target"] * tb,
             "draft_weights": n["draft_trainable"] * (4 + 2) + n["draft_frozen_bytes"],  # fp32 master + bf16 copy; frozen as built
             "gradients": n["draft_trainable"] * 4,
             "optimizer": n["draft_trainable"] * 8,  # AdamW: exp_avg + exp_avg_sq, fp32
             "activations": rows * act["per_row_values"] * 4 + batch_size * seq_len * act["per_target_token_bytes"]}
    fsdp = {k: (v if k == "activations" else -(-v // max(devices, 1))) for k, v in parts.items()}
    fsdp["fsdp_gather_peak"] = largest_unit(target, head) * 2  # one unit's full bf16 weights while it runs
    return {"replicated": {**parts, "total": sum(parts.values())}, "fsdp": {**fsdp, "total": sum(fsdp.values())},
            "activation_estimate": {"draft_rows_per_device": rows, "values_per_row": act["per_row_values"],
                                    "target_bytes_per_token": act["per_target_token_bytes"], "bytes_per_value": 4,
                                    "how": "Σ(in+out) over the head's linear layers + 2·draft vocabulary per draft row, "
                                           "fp32; plus the target's returned hidden states and teacher logits per token"}}


def cache_bytes_per_token(target: Any, dtype: str = "bfloat16") -> dict:
    """A feature cache's bytes per token (:func:`data.features.write_features`): the taps and the last state in
    ``dtype``, the token id (int32) and the loss mask (uint8)."""
    from models.target import DTYPES

    b = BYTES[DTYPES[dtype]]
    d, n = target.hidden_size, len(target.tap_layers)
    return {"taps": n * d * b, "last_state": d * b, "ids_and_mask": 4 + 1, "total": n * d * b + d * b + 5}


def read_throughput(path: str | None) -> dict:
    """Tokens per second of one device from ``python -m eval.bench_train``'s ``bench_train.json`` (its first
    precision) or any JSON with ``tokens_per_s`` / ``regeneration_tokens_per_s``; {} when none was given."""
    if not path:
        return {}
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"throughput={path}: no such file (the bench_train.json of `python -m eval.bench_train`)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"throughput={path}: not a JSON file ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise UserError(f"throughput={path}: not a bench_train.json (a JSON object expected)")
    out: dict = {}
    precisions = raw.get("precisions")
    if isinstance(precisions, dict) and precisions:
        prec, row = next(iter(precisions.items()))
        out.update({"precision": prec, "train_online_tokens_per_s": row.get("online_tokens_per_s"),
                    "train_offline_tokens_per_s": row.get("offline_tokens_per_s"),
                    "target_forward_tokens_per_s": row.get("target_forward_tokens_per_s")})
    for k in ("regeneration_tokens_per_s", "tokens_per_s"):
        if isinstance(raw.get(k), (int, float)):
            out["regeneration_tokens_per_s"] = raw[k]
            break
    out = {k: v for k, v in out.items() if v is not None}
    if not out:
        raise UserError(f"throughput={path}: no tokens/s in it (expected bench_train.json's precisions.*.online_tokens_per_s "
                        "or a tokens_per_s field)")
    out["source"] = str(p)
    out["device"] = raw.get("device")
    return out


def times(tokens: int, devices: int, tp: dict) -> dict:
    """Hours for ``tokens`` tokens at the measured tokens/s of one device × ``devices`` (linear scaling assumed);
    "not measured" where no throughput says."""
    def hours(key: str) -> float | str:
        v = tp.get(key)
        return round(tokens / (v * devices) / 3600, 3) if isinstance(v, (int, float)) and v > 0 else "not measured"

    return {"regeneration_h": hours("regeneration_tokens_per_s"), "feature_cache_h": hours("target_forward_tokens_per_s"),
            "train_online_epoch_h": hours("train_online_tokens_per_s"),
            "train_offline_epoch_h": hours("train_offline_tokens_per_s"),
            "scaling": f"one device's measured tokens/s × {devices} (linear scaling assumed, not measured)"}


def build_plan(cfg: Any) -> dict:
    """The whole plan of a planner config (``plan=true``)."""
    devices, tokens = cfg.get("devices", 1), cfg.get("tokens", 0)
    if not isinstance(devices, int) or devices < 1:
        raise UserError(f"devices={devices}: the number of devices, an integer >= 1")
    if not isinstance(tokens, int) or tokens < 0:
        raise UserError(f"tokens={tokens}: training tokens to plan for, an integer >= 0")
    batch, seq = cfg.get("batch_size"), cfg.get("seq_len")
    for k, v in (("batch_size", batch), ("seq_len", seq)):
        if not isinstance(v, int) or v < 1:
            raise UserError(f"{k}={v}: an integer >= 1")
    strategy = trainer_strategy(cfg.trainer)
    target, head = meta_models(cfg)
    online = str(cfg.get("features", "online")) != "offline"
    mem = memory(target, head, devices, batch, seq, online)
    cache = cache_bytes_per_token(target, str(cfg.get("cache_dtype", "bfloat16")))
    tp = read_throughput(cfg.get("throughput"))
    return {"target": str(cfg.target.name_or_path), "architecture": (target.config.architectures or ["?"])[0],
            "target_dtype": str(target.model.dtype).removeprefix("torch."), "draft": head.family,
            "strategy": strategy, "devices": devices, "batch_size_per_device": batch, "seq_len": seq,
            "features": "online" if online else "offline", "parameters": parameter_counts(target, head),
            "bytes_per_device": mem["fsdp" if strategy == "fsdp" else "replicated"],
            "replicated": mem["replicated"], "fsdp": mem["fsdp"], "activation_estimate": mem["activation_estimate"],
            "cache": {"bytes_per_token": cache, "tokens": tokens, "total_bytes": cache["total"] * tokens},
            "throughput": tp or "not measured", "time": times(tokens, devices, tp)}


def trainer_strategy(trainer: Any) -> str:
    """``fsdp`` for an FSDP strategy, ``ddp`` for DDP, else ``single`` (one device)."""
    s = trainer.get("strategy") if trainer is not None else None
    text = json.dumps(s if isinstance(s, (str, type(None))) else dict(s)).lower() if s is not None else ""
    if "fsdp" in text:
        return "fsdp"
    if "ddp" in text:
        return "ddp"
    return "single"


def table(plan: dict) -> str:
    """The plan as a readable table."""
    gib = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    p, r, f = plan["parameters"], plan["replicated"], plan["fsdp"]
    lines = [f"target {plan['target']} ({plan['architecture']}, {plan['target_dtype']}), draft {plan['draft']}, "
             f"{plan['strategy']} over {plan['devices']} device(s), batch {plan['batch_size_per_device']} × "
             f"{plan['seq_len']} tokens per device, {plan['features']} features",
             f"parameters: target {p['target'] / 1e9:.3f} B; draft trainable {p['draft_trainable'] / 1e6:.1f} M of "
             f"{p['draft_total'] / 1e6:.1f} M",
             "", f"{'GiB per device':<26}{'gpu/ddp':>9}  {'fsdp/' + str(plan['devices']):>9}"]
    for k, name in (("target_weights", "target weights (frozen)"), ("draft_weights", "draft weights fp32+bf16"),
                    ("gradients", "gradients (fp32)"), ("optimizer", "optimiser (AdamW 2×fp32)"),
                    ("activations", "activations (estimate)"), ("fsdp_gather_peak", "fsdp gather peak")):
        lines.append(f"{name:<26}{gib(r.get(k, 0))}  {gib(f.get(k, 0))}")
    lines.append(f"{'total':<26}{gib(r['total'])}  {gib(f['total'])}")
    a = plan["activation_estimate"]
    lines += [f"activations: an estimate, {a['draft_rows_per_device']} draft rows × {a['values_per_row']} values × 4 B "
              f"+ {a['target_bytes_per_token']} B per target token ({a['how']})"]
    c = plan["cache"]
    lines += ["", f"feature cache: {c['bytes_per_token']['total']} B per token (taps {c['bytes_per_token']['taps']}, "
                  f"last state {c['bytes_per_token']['last_state']}, ids+mask 5); {c['tokens']} tokens: "
                  f"{c['total_bytes'] / GIB:.2f} GiB"]
    t = plan["time"]
    fmt = lambda v: v if isinstance(v, str) else f"{v} h"  # noqa: E731
    lines += [f"time: regeneration {fmt(t['regeneration_h'])}; feature cache {fmt(t['feature_cache_h'])}; "
              f"one epoch online {fmt(t['train_online_epoch_h'])}, offline {fmt(t['train_offline_epoch_h'])}"
              + ("" if plan["throughput"] == "not measured" else f" ({t['scaling']})")]
    return "\n".join(lines)
