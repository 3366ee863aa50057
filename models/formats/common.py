"""What the engine modules share: reading a head's architecture, writing layer configs, reading engine configs,
renaming tensors, and the import steps one family shares across engines (EAGLE-3: speculators and SGLang;
DFlash: speculators and z-lab)."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Callable

import torch

from data.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the head class each family's import rebuilds (unless the export's own ``draftsmith`` block names another)
HEAD_CLASSES = {"eagle3": "models.heads.eagle3.Eagle3Head", "dflash": "models.heads.dflash.DFlashHead",
                "dspark": "models.heads.dspark.DSparkHead", "mtp": "models.heads.mtp.MTPHead"}


# -- reading our heads ----------------------------------------------------------------------------
def rope_theta_of(rotary: torch.nn.Module) -> float:
    """The base θ of a :class:`models.layers.Rotary`, recovered from its frequencies (exact when θ is a round number)."""
    inv = rotary.inv_freq.float().cpu()
    hd = 2 * inv.numel()
    est = float(inv[1].double() ** (-hd / 2)) if inv.numel() > 1 else 10000.0
    for theta in (float(f"{est:.6g}"), est):
        if torch.equal(1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)), inv):
            return theta
    return est


def head_dims(head: Any) -> dict:
    """Architecture numbers of a servable head, read from its modules (never recomputed): the attention and MLP
    sizes of its :meth:`~models.heads.base.DraftHead.decoder_layer`, plus what the family adds (``serving_dims``)."""
    layer = head.decoder_layer()
    a, mlp = layer.self_attn, layer.mlp
    dims = {"num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv, "head_dim": a.hd,
            "intermediate_size": mlp.gate_proj.out_features, "rope_theta": rope_theta_of(head.rotary),
            "qk_norm": hasattr(a, "q_norm") and hasattr(a, "k_norm")}
    return dims | head.serving_dims()


def require_qk_norm(head: Any, fmt: str) -> None:
    if not head_dims(head)["qk_norm"]:
        raise UserError(f"format={fmt} cannot hold this {head.family} draft: its layers have no per-head q/k RMSNorm "
                        f"(layers.N.self_attn.q_norm/k_norm), which every DFlash layer in speculators, vLLM, SGLang and "
                        f"z-lab applies; train it with q/k-normed DFlash layers")


def require_full_vocab(head: Any, fmt: str) -> None:
    """Block drafters are written over the target's full head; one trained on a draft vocabulary is refused."""
    if getattr(head, "draft_vocab_size", None):
        raise UserError(f"format={fmt} here writes {head.family} drafts over the target's full vocabulary, and this one "
                        f"was trained on {head.draft_vocab_size} draft tokens (draft.draft_vocab_size); train it with "
                        f"draft.draft_vocab_size=null to export it")


# -- writing ----------------------------------------------------------------------------------------
def layer_config(model_type: str, dims: dict, tc: Any, num_layers: int, dtype: str) -> dict:
    """A Llama/Qwen3 decoder config for the draft's own layers (explicit, so no reader falls back to a default)."""
    theta = dims["rope_theta"]
    c = {"model_type": model_type, "vocab_size": dims["vocab_size"], "hidden_size": dims["hidden_size"],
         "intermediate_size": dims["intermediate_size"], "num_hidden_layers": num_layers,
         "num_attention_heads": dims["num_attention_heads"], "num_key_value_heads": dims["num_key_value_heads"],
         "head_dim": dims["head_dim"], "hidden_act": "silu",
         "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 2048),
         "rms_norm_eps": dims["rms_norm_eps"], "rope_theta": theta,
         "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "attention_bias": False,
         "attention_dropout": 0.0, "tie_word_embeddings": False, "dtype": dtype, "torch_dtype": dtype}
    if model_type == "llama":
        c["mlp_bias"] = False
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        c[k] = getattr(tc, k, None)
    return c


def renamed(state: dict[str, torch.Tensor], rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    """``state`` with every key renamed; a key renamed to None is dropped."""
    out = {}
    for k, v in state.items():
        new = rename(k)
        if new is not None:
            out[new] = v
    return out


def block_body(k: str) -> str | None:
    """DFlash/DSpark state names shared by speculators and z-lab (embedding and head come from the target)."""
    return None if k in ("embed_tokens.weight", "lm_head.weight") else k


# -- reading ----------------------------------------------------------------------------------------
def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # truncated or not safetensors: one line naming the file
            raise UserError(f"{f}: unreadable weights ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'damaged'})") from None
    return state


def need(c: dict, key: str, where: str) -> Any:
    if c.get(key) is None:
        raise UserError(f"{where}: missing field {key!r}")
    return c[key]


def layer_config_of(raw: dict, key: str = "transformer_layer_config") -> dict:
    c = raw.get(key)
    if not isinstance(c, dict):
        raise UserError(f"config: missing field {key!r}")
    return c


def rope_of(c: dict, where: str) -> float:
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind != "default":
        raise UserError(f"{where}.rope_parameters: rope_type {kind!r} is not supported (drafts here use plain RoPE)")
    return float(rp.get("rope_theta") or c.get("rope_theta") or 10000.0)


def arch_expect(c: dict, where: str) -> dict:
    """What a (Llama/Qwen3-style) layer config fixes that our constructors derive: checked after construction."""
    d, n = int(need(c, "hidden_size", where)), int(need(c, "num_attention_heads", where))
    expect = {"hidden_size": d, "num_attention_heads": n, "num_key_value_heads": int(c.get("num_key_value_heads") or n),
              "head_dim": int(c.get("head_dim") or d // n), "intermediate_size": int(need(c, "intermediate_size", where)),
              "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)), "rope_theta": rope_of(c, where)}
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise UserError(f"{where}.{flag}=true: the draft layers here have no biases")
    if any(t != "full_attention" for t in c.get("layer_types") or []):
        raise UserError(f"{where}.layer_types: sliding-window layers are not supported (full attention only)")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}.hidden_act={act!r}: the draft layers here use SiLU (SwiGLU)")
    return expect


def base_config(own: dict, family: str) -> dict:
    """Our config to rebuild a head: the export's own block when present (training-only settings), else defaults."""
    cls = HEAD_CLASSES[family]
    if own.get("family") == family:
        return {"class": own.get("class", cls), "init_args": dict(own.get("init_args") or {}), "target": own.get("target")}
    return {"class": cls, "init_args": {}, "target": None}


class Named(dict):
    """A state dict in our names that remembers each tensor's name in the file (for error messages)."""
    file_names: dict[str, str]


def rename_in(state: dict, fn: Callable[[str], str]) -> dict:
    out = Named({fn(k): v for k, v in state.items()})
    out.file_names = {fn(k): getattr(state, "file_names", {}).get(k, k) for k in state}
    return out


def head_class(path: str) -> type:
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


# -- one family's import steps shared by two engines --------------------------------------------------
def eagle3_finish(raw: dict, c: dict, where: str, state: dict, target: Any, taps: list[int], k: int | None) -> tuple[dict, dict]:
    """EAGLE-3 from an engine's layer config ``c`` (at ``where``), tensors in our names, taps and draft length."""
    expect = arch_expect(c, where)
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{where}.num_hidden_layers={c.get('num_hidden_layers')}: the EAGLE-3 head here has one decoder layer")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise UserError(f"config.{flag}=true: the EAGLE-3 head here does not have this variant")
    if raw.get("target_hidden_size") not in (None, expect["hidden_size"]):
        raise UserError(f"config.target_hidden_size={raw['target_hidden_size']}: the EAGLE-3 head here needs the target's "
                        f"hidden size equal to its own ({expect['hidden_size']})")
    V = int(need(c, "vocab_size", where))
    Vd = int(raw.get("draft_vocab_size") or V)
    state.setdefault("embed_tokens.weight", target.embed_tokens().weight.detach().float())
    if "lm_head.weight" not in state and Vd == V:
        state["lm_head.weight"] = target.lm_head().weight.detach().float()
    if "d2t" not in state and "t2d" not in state and Vd == V:
        state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    vocab_map(state, Vd, V)
    cfg = base_config(raw.get("draftsmith") or {}, "eagle3")
    if k is not None or "ttt_steps" not in cfg["init_args"]:
        cfg["init_args"]["ttt_steps"] = k or 7
    cfg["init_args"].update(draft_vocab_size=Vd, num_heads=expect["num_attention_heads"],
                            num_kv_heads=expect["num_key_value_heads"], intermediate_size=expect["intermediate_size"],
                            rope_theta=expect["rope_theta"], rms_eps=expect["rms_norm_eps"])
    expect.update(vocab_size=V, draft_vocab_size=Vd)
    return cfg | {"family": "eagle3", "tap_layers": taps, "expect": expect, "where": where}, state


def vocab_map(state: dict, Vd: int, V: int) -> None:
    """The draft vocabulary's ``d2t``/``t2d`` in ``state`` checked against ``draft_vocab_size`` and typed as ours."""
    for name in ("d2t", "t2d"):
        if name not in state:
            raise UserError(f"model.safetensors: missing {name!r} (draft_vocab_size={Vd} < vocab_size={V} needs the vocabulary map)")
    if int(state["t2d"].bool().sum()) != Vd:
        raise UserError(f"model.safetensors: t2d marks {int(state['t2d'].bool().sum())} tokens, draft_vocab_size is {Vd}")
    state["t2d"] = state["t2d"].bool()
    state["d2t"] = state["d2t"].long()


def block_finish(raw: dict, c: dict, where: str, state: dict, target: Any, family: str, taps: list[int], block: int,
                 mask_id: int) -> tuple[dict, dict]:
    """DFlash/DSpark from an engine's layer config ``c`` (at ``where``), tensors in our names, taps, block, MASK id."""
    expect = arch_expect(c, where)
    V = int(need(c, "vocab_size", where))
    Vd = int(raw.get("draft_vocab_size") or V)
    cfg = base_config(raw.get("draftsmith") or {}, family)
    cfg["init_args"].update(block_size=block, num_layers=int(need(c, "num_hidden_layers", where)), mask_token_id=int(mask_id),
                            rms_eps=expect["rms_norm_eps"])
    if "layers.0.self_attn.q_norm.weight" in state:
        if "qk_norm" not in inspect.signature(head_class(cfg["class"]).__init__).parameters:
            raise UserError(f"this {family} checkpoint's layers apply per-head q/k RMSNorm (layers.N.self_attn.q_norm), "
                            f"which the {family} head here ({cfg['class']}) does not have")
        cfg["init_args"]["qk_norm"] = True
    dropped = ("verifier_",) if Vd < V else ("verifier_", "t2d", "d2t")  # the full vocabulary's maps say nothing
    for k in [k for k in state if k.startswith(dropped)]:
        del state[k]  # speculators' verifier copies (rebuilt from the target by every reader)
    if Vd < V:  # a draft vocabulary: its head rows are the target's (reselected on load), d2t/t2d say which
        vocab_map(state, Vd, V)
        state["draft_head.weight"] = state.pop("lm_head.weight", None)
        if state["draft_head.weight"] is None:
            raise UserError(f"model.safetensors: missing 'lm_head.weight' (draft_vocab_size={Vd} < vocab_size={V} "
                            "needs the draft vocabulary's head rows)")
        cfg["init_args"]["draft_vocab_size"] = Vd
        expect["draft_vocab_size"] = Vd
    state.setdefault("embed_tokens.weight", target.embed_tokens().weight.detach().float())
    state.setdefault("lm_head.weight", target.lm_head().weight.detach().float())
    expect.update(vocab_size=V, num_hidden_layers=cfg["init_args"]["num_layers"])
    return cfg | {"family": family, "tap_layers": taps, "expect": expect, "where": where}, state
