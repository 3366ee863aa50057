"""Serving formats: trained drafts out to vLLM, SGLang and z-lab DFlash, and published checkpoints back in.

Formats (``format=`` of ``python -m train.export``) and the families each can hold (:data:`FORMATS`):

- ``speculators``: vLLM's format, defined by the ``speculators`` library (0.9.0): ``config.json`` with
  ``speculators_model_type``, ``architectures``, ``speculators_version``, ``speculators_config`` (algorithm,
  proposal methods, verifier) and ``transformer_layer_config``; ``model.safetensors`` named as that
  library's model classes name their parameters. EAGLE-3 (``Eagle3DraftModel``), DFlash
  (``DFlashDraftModel``), DSpark (``DSparkDraftModel``), MTP (``MTPDraftModel``: one Qwen3 layer reused at every
  depth and fed its own normed output; only an MTP head built in that layout, ``draft=mtp_speculators``).
- ``sglang``: SGLang's EAGLE-3 layout (``LlamaForCausalLMEagle3`` config with ``draft_vocab_size`` and
  ``eagle_config``; weights ``fc``, ``midlayer``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, no embedding).
- ``dflash``: z-lab's DFlash layout (Qwen3-style config plus ``block_size``, ``num_target_layers`` and
  ``dflash_config {mask_token_id, target_layer_ids}``), which SGLang serves with ``--speculative-algorithm DFLASH``.

Every export also carries our own config under the key ``draftsmith`` (ignored by the engines), so that
an import restores training-only settings; the architecture is always read from the engine's fields.

Layer ids: engines disagree on how to number the target layers a draft reads. We, SGLang's
``eagle_config`` and z-lab's ``dflash_config`` name the *output* of decoder layer i (Hugging Face
``hidden_states[i + 1]``); speculators and vLLM name the index into ``hidden_states``, i.e. the *input* of
layer i (vLLM's own DFlash reader subtracts one, see vllm#40727). :func:`engine_layer_ids` and
:func:`our_layer_ids` are the only conversion, built on :func:`models.target.hf_hidden_index`.

Import (:func:`detect_format`, :func:`import_draft`, :func:`check_import`) is what
:func:`models.heads.base.load_draft` calls for a directory in one of these formats, so
``eval.run.load_head path=<speculators dir>`` works as for our own exports.
"""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from data.errors import UserError, atomic_dir
from models.target import hf_hidden_index

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose model classes define the names used here
FORMATS: dict[str, tuple[str, ...]] = {"speculators": ("eagle3", "dflash", "dspark", "mtp"), "sglang": ("eagle3",),
                                       "dflash": ("dflash",)}
# what no format here can hold, and why (shown when such an export is asked for)
CANNOT: dict[tuple[str, str], str] = {}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# -- layer ids: the one conversion --------------------------------------------------------------------
# "output": id i = the output of decoder layer i (ours, SGLang eagle_config, z-lab dflash_config);
# "hidden_states": id = index into Hugging Face hidden_states = the input of decoder layer id (speculators, vLLM).
LAYER_IDS = {"draftsmith": "output", "sglang": "output", "dflash": "output", "speculators": "hidden_states"}


def engine_layer_ids(taps: list[int], fmt: str) -> list[int]:
    """Our tap layers (decoder-layer outputs) → the ids ``fmt`` writes in its config."""
    if LAYER_IDS[fmt] == "hidden_states":
        return [hf_hidden_index(int(i)) for i in taps]
    return [int(i) for i in taps]


def our_layer_ids(ids: list[int], fmt: str, field: str = "layer ids") -> list[int]:
    """The ids of ``fmt``'s config → our tap layers; ``field`` names the config field in errors."""
    ids = [int(i) for i in ids]
    if LAYER_IDS[fmt] == "hidden_states":
        ids = [i - hf_hidden_index(0) for i in ids]
        if min(ids, default=0) < 0:
            raise UserError(f"{field}: id 0 is the embedding output, not a decoder layer's; drafts here read decoder-layer outputs")
    return ids


# -- reading our heads ----------------------------------------------------------------------------
def _rope_theta(rotary: torch.nn.Module) -> float:
    """The base θ of a :class:`models.layers.Rotary`, recovered from its frequencies (exact when θ is a round number)."""
    inv = rotary.inv_freq.float().cpu()
    hd = 2 * inv.numel()
    est = float(inv[1].double() ** (-hd / 2)) if inv.numel() > 1 else 10000.0
    for theta in (float(f"{est:.6g}"), est):
        if torch.equal(1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)), inv):
            return theta
    return est


def _layer(head: Any) -> Any:
    """The (first) decoder layer of a head: the one whose sizes the engine config names."""
    if head.family == "eagle3":
        return head.midlayer
    return head.layers[0].block if head.family == "mtp" else head.layers[0]


def head_dims(head: Any) -> dict:
    """Architecture numbers of an EAGLE-3 / DFlash / DSpark / MTP head, read from its modules (never recomputed)."""
    layer = _layer(head)
    a, mlp = layer.self_attn, layer.mlp
    dims = {"num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv, "head_dim": a.hd,
            "intermediate_size": mlp.gate_proj.out_features, "rope_theta": _rope_theta(head.rotary),
            "qk_norm": hasattr(a, "q_norm") and hasattr(a, "k_norm")}
    if head.family == "mtp":
        m = head.layers[0]
        return dims | {"hidden_size": m.eh_proj.out_features, "rms_norm_eps": m.norm.eps, "vocab_size": head.lm_head.out_features,
                       "num_modules": len(head.layers), "chain_normed": m.norm_output}
    dims.update(hidden_size=head.fc.out_features, rms_norm_eps=head.norm.eps, num_taps=head.fc.in_features // head.fc.out_features)
    if head.family == "eagle3":
        dims.update(vocab_size=head.t2d.numel(), draft_vocab_size=head.draft_vocab_size, num_hidden_layers=1)
    else:
        dims.update(vocab_size=head.lm_head.out_features, num_hidden_layers=len(head.layers))
    if head.family == "dspark":
        dims["markov_rank"] = head.markov_in.embedding_dim
    return dims


def _layer_config(model_type: str, dims: dict, tc: Any, num_layers: int, dtype: str) -> dict:
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


def _speculators_envelope(algorithm: str, arch: str, speculative_tokens: int, verifier: dict) -> dict:
    return {"architectures": [arch], "speculators_model_type": algorithm, "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {"algorithm": algorithm,
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "default_proposal_method": "greedy", "verifier": verifier}}


def _renamed(state: dict[str, torch.Tensor], rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        new = rename(k)
        if new is not None:
            out[new] = v
    return out


def _require_qk_norm(head: Any, fmt: str) -> None:
    if not head_dims(head)["qk_norm"]:
        raise UserError(f"format={fmt} cannot hold this {head.family} draft: its layers have no per-head q/k RMSNorm "
                        f"(layers.N.self_attn.q_norm/k_norm), which every DFlash layer in speculators, vLLM, SGLang and "
                        f"z-lab applies; train it with q/k-normed DFlash layers")


# -- exporters: (head, target config, verifier) → (config.json dict, tensors) -------------------------
def _eagle3_speculators(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    cfg = _speculators_envelope("eagle3", "Eagle3Speculator", head.ttt_steps, verifier)
    cfg.update(transformer_layer_config=_layer_config("llama", d, tc, 1, dtype), draft_vocab_size=d["draft_vocab_size"],
               norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False,
               embed_requires_grad=False, target_hidden_size=None,
               eagle_aux_hidden_state_layer_ids=engine_layer_ids(head.tap_layers, "speculators"))
    # speculators saves EAGLE-3 drafts with their (frozen) embedding, and its loader relies on it being there:
    # without it from_pretrained leaves a freshly initialised table instead of the verifier's
    full_vocab = d["draft_vocab_size"] == d["vocab_size"]  # speculators keeps no d2t/t2d then
    state = _renamed(head.state_dict(), lambda k: None if full_vocab and k in ("d2t", "t2d")
                     else k.replace("midlayer.", "layers.0.", 1))
    return cfg, state


def _eagle3_sglang(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    if d["num_taps"] != 3:
        raise UserError(f"format=sglang cannot hold this eagle3 draft: SGLang's EAGLE-3 fc reads exactly 3 target layers, "
                        f"this draft reads {d['num_taps']} ({head.tap_layers})")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_config("llama", d, tc, 1, dtype),
           "draft_vocab_size": d["draft_vocab_size"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(head.tap_layers, "sglang"),
                            "use_aux_hidden_state": True}}
    state = _renamed(head.state_dict(), lambda k: None if k == "embed_tokens.weight" else k)
    return cfg, state


def _dflash_body(k: str) -> str | None:
    """DFlash/DSpark state names shared by speculators and z-lab (embedding and head come from the target)."""
    return None if k in ("embed_tokens.weight", "lm_head.weight") else k


def _dflash_speculators(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    _require_qk_norm(head, "speculators")
    d = head_dims(head)
    spark = head.family == "dspark"
    cfg = _speculators_envelope(head.family, "DSparkSpeculator" if spark else "DFlashSpeculator",
                                head.block_size if spark else head.block_size - 1, verifier)
    cfg.update(transformer_layer_config=_layer_config("qwen3", d, tc, d["num_hidden_layers"], dtype),
               draft_vocab_size=d["vocab_size"], block_size=head.block_size, target_hidden_size=None,
               aux_hidden_state_layer_ids=engine_layer_ids(head.tap_layers, "speculators"),
               mask_token_id=head.mask_token_id, sliding_window_non_causal=False, sample_from_anchor=spark)
    names = {}
    if spark:
        cfg.update(markov_rank=d["markov_rank"], markov_head_type="vanilla", enable_confidence_head=True,
                   confidence_head_with_markov=True)
        names = {"markov_in.weight": "markov_head.markov_w1.weight", "markov_out.weight": "markov_head.markov_w2.weight",
                 "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}
    state = _renamed(head.state_dict(), lambda k: names.get(k, _dflash_body(k)))
    return cfg, state


def _dflash_zlab(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    _require_qk_norm(head, "dflash")
    d = head_dims(head)
    cfg = {"architectures": ["DFlashDraftModel"], **_layer_config("qwen3", d, tc, d["num_hidden_layers"], dtype),
           "block_size": head.block_size, "num_target_layers": int(tc.num_hidden_layers),
           "dflash_config": {"mask_token_id": head.mask_token_id, "target_layer_ids": engine_layer_ids(head.tap_layers, "dflash")}}
    return cfg, _renamed(head.state_dict(), _dflash_body)


# speculators' MTPDraftModel names (mtp_layers.0.<its name>) for our MTPModule parts; the block's own parts keep theirs
MTP_NAMES = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj", "norm": "final_layernorm"}


def _mtp_speculators(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    differs = [why for bad, why in ((d["num_modules"] != 1, f"{d['num_modules']} modules (shared_module)"),
                                    (not d["qk_norm"], "no q/k norms (qk_norm)"),
                                    (not d["chain_normed"], "pre-norm states handed on (chain_normed)")) if bad]
    if differs:
        raise UserError(f"format=speculators cannot hold this mtp draft: speculators' MTP is one Qwen3 layer reused at every "
                        f"depth and fed its own normed output, this draft has {', '.join(differs)}; "
                        f"train it with draft=mtp_speculators")
    cfg = _speculators_envelope("mtp", "MTPDraftModel", head.num_steps, verifier)
    # speculators' MTP reads hidden_states[transformer_layer_config.num_hidden_layers]: the target's last layer, whose
    # Hugging Face entry is the final-norm output (our last_state); so the layer config keeps the target's layer count
    last = engine_layer_ids([int(tc.num_hidden_layers) - 1], "speculators")[0]
    cfg.update(transformer_layer_config=_layer_config("qwen3", d, tc, last, dtype), num_nextn_predict_layers=1)

    def rename(k: str) -> str | None:
        if k in ("embed_tokens.weight", "lm_head.weight"):
            return None  # speculators always loads the verifier's (ours are frozen copies of them)
        part, _, rest = k.removeprefix("layers.0.").partition(".")
        return f"mtp_layers.0.{rest}" if part == "block" else f"mtp_layers.0.{MTP_NAMES[part]}.{rest}"

    return cfg, _renamed(head.state_dict(), rename)


EXPORTERS: dict[tuple[str, str], Callable] = {("speculators", "eagle3"): _eagle3_speculators, ("sglang", "eagle3"): _eagle3_sglang,
                                              ("speculators", "dflash"): _dflash_speculators,
                                              ("speculators", "dspark"): _dflash_speculators, ("dflash", "dflash"): _dflash_zlab,
                                              ("speculators", "mtp"): _mtp_speculators}


def check_exportable(family: str, fmt: str) -> None:
    """A UserError unless format ``fmt`` can hold a ``family`` draft (the message lists the formats that can)."""
    if fmt not in FORMATS:
        raise UserError(f"format={fmt!r}: use one of {', '.join(FORMATS)}")
    if family in FORMATS[fmt]:
        return
    can = [f for f, fams in FORMATS.items() if family in fams]
    why = CANNOT.get((fmt, family))
    where = f"formats that can: {', '.join(can)}" if can else \
        "no serving format holds it (" + "; ".join(f"{f}: {', '.join(fams)}" for f, fams in FORMATS.items()) + ")"
    raise UserError(f"format={fmt} cannot hold a {family} draft{f' ({why})' if why else ''}; {where}")


def _verifier_entry(name: str, target: Any) -> dict:
    from models.target import EMBEDDED, EMBEDDED_PATH

    if name == EMBEDDED:
        name = str(EMBEDDED_PATH)
    elif Path(name).expanduser().exists():
        name = str(Path(name).expanduser().resolve())
    return {"name_or_path": name, "architectures": list(target.config.architectures or [])}


def resolve_draft_dir(path: str | Path) -> Path:
    """A run directory (its ``draft/`` export) or a draft directory (ours or a serving format)."""
    p = Path(path).expanduser()
    if (p / "config.json").exists():
        return p
    if (p / "draft" / "config.json").exists():
        return p / "draft"
    raise UserError(f"src={path}: neither an exported draft nor a run directory with draft/config.json "
                    f"(train one with `python -m train`)")


def draft_family(path: Path) -> tuple[str, dict]:
    """(family, recorded target identity or {}) of a draft directory in any format import reads."""
    from models.heads.base import read_draft_config

    fmt = detect_format(path)
    if fmt is None:
        cfg = read_draft_config(path)
        return cfg["family"], cfg.get("target", {})
    raw = _read_json(path / "config.json")
    own = raw.get("draftsmith") or {}
    family = {"speculators": raw.get("speculators_model_type"), "sglang": "eagle3", "dflash": "dflash"}[fmt]
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return str(family), own.get("target") or ({"name_or_path": verifier} if verifier else {})


def load_export_target(identity: dict, verifier: str | None, draft: Path) -> Any:
    """The frozen target a draft is exported for: ``verifier`` if given, else the target the draft records."""
    from models.target import FrozenTarget

    name = verifier or identity.get("name_or_path")
    if not name:
        raise UserError(f"draft {draft} does not record its target; pass verifier=<HF id or local path of the target model>")
    try:
        return FrozenTarget(str(name), dtype="float32")
    except (UserError, OSError, ValueError) as e:
        if verifier:
            raise UserError(f"verifier={verifier!r}: could not load it ({str(e).splitlines()[0]})") from None
        raise UserError(f"draft {draft} records its target as {name!r}, which cannot be loaded here "
                        f"({str(e).splitlines()[0]}); pass verifier=<HF id or local path of the target model>") from None


def export_draft(draft: str | Path, fmt: str, out: str | Path, verifier: str | None = None, dtype: str | None = None) -> Path:
    """Convert a trained draft (run dir, our export, or any format import reads) to ``fmt`` in ``out`` (atomically)."""
    from safetensors.torch import save_file

    from models.heads.base import load_draft

    src = resolve_draft_dir(draft)
    family, identity = draft_family(src)
    check_exportable(family, fmt)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)} (or null: as trained)")
    out = Path(out).expanduser()
    if out.resolve() == src.resolve() or src.resolve().is_relative_to(out.resolve()):
        raise UserError(f"out={out}: would overwrite the draft it is exported from; choose another directory")
    target = load_export_target(identity, verifier, src)
    head = load_draft(src, target).eval()
    if dtype is None:  # as trained: the dtype of the head's trainable weights
        have = next(p.dtype for p in head.parameters() if p.requires_grad)
        dtype = next(n for n, t in DTYPES.items() if t == have)
    cfg, state = EXPORTERS[(fmt, family)](head, target.config, _verifier_entry(verifier or identity.get("name_or_path")
                                                                                or target.name_or_path, target), dtype)
    cfg["draftsmith"] = _own_config(head)
    state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()}
    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _own_config(head: Any) -> dict:
    from models.heads.base import FORMAT

    return {"format": FORMAT, "family": head.family, "class": f"{type(head).__module__}.{type(head).__qualname__}",
            "init_args": head.init_args, "target": head.target_identity, "tap_layers": list(head.tap_layers),
            "num_steps": head.num_steps}


# -- import ---------------------------------------------------------------------------------------
def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: malformed JSON ({e.msg})") from None


def detect_format(path: str | Path) -> str | None:
    """``speculators`` / ``sglang`` / ``dflash`` for a directory in that serving format; None otherwise (ours or unknown)."""
    p = Path(path) / "config.json"
    if not p.exists():
        return None
    cfg = _read_json(p)
    if cfg.get("format") is not None and "speculators_model_type" not in cfg:
        return None
    arch = [str(a) for a in cfg.get("architectures") or []]
    if "speculators_model_type" in cfg:
        return "speculators"
    if "dflash_config" in cfg or any("DFlash" in a for a in arch):
        return "dflash"
    if "eagle_config" in cfg or any("Eagle3" in a for a in arch):
        return "sglang"
    return None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _rope_of(c: dict, where: str) -> float:
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind != "default":
        raise UserError(f"{where}.rope_parameters: rope_type {kind!r} is not supported (drafts here use plain RoPE)")
    return float(rp.get("rope_theta") or c.get("rope_theta") or 10000.0)


def _arch_expect(c: dict, where: str) -> dict:
    """What a (Llama/Qwen3-style) layer config fixes that our constructors derive: checked after construction."""
    d, n = int(_need(c, "hidden_size", where)), int(_need(c, "num_attention_heads", where))
    expect = {"hidden_size": d, "num_attention_heads": n, "num_key_value_heads": int(c.get("num_key_value_heads") or n),
              "head_dim": int(c.get("head_dim") or d // n), "intermediate_size": int(_need(c, "intermediate_size", where)),
              "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)), "rope_theta": _rope_of(c, where)}
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise UserError(f"{where}.{flag}=true: the draft layers here have no biases")
    if any(t != "full_attention" for t in c.get("layer_types") or []):
        raise UserError(f"{where}.layer_types: sliding-window layers are not supported (full attention only)")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}.hidden_act={act!r}: the draft layers here use SiLU (SwiGLU)")
    return expect


def _need(c: dict, key: str, where: str) -> Any:
    if c.get(key) is None:
        raise UserError(f"{where}: missing field {key!r}")
    return c[key]


def _base(own: dict, family: str, cls: str) -> dict:
    """Our config to rebuild a head: the export's own block when present (training-only settings), else defaults."""
    if own.get("family") == family:
        return {"class": own.get("class", cls), "init_args": dict(own.get("init_args") or {}), "target": own.get("target")}
    return {"class": cls, "init_args": {}, "target": None}


def _eagle3_import(fmt: str, raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    where = "transformer_layer_config" if fmt == "speculators" else "config"
    c = raw.get("transformer_layer_config") if fmt == "speculators" else raw
    if not isinstance(c, dict):
        raise UserError("config: missing field 'transformer_layer_config'")
    expect = _arch_expect(c, where)
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{where}.num_hidden_layers={c.get('num_hidden_layers')}: the EAGLE-3 head here has one decoder layer")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise UserError(f"config.{flag}=true: the EAGLE-3 head here does not have this variant")
    if raw.get("target_hidden_size") not in (None, expect["hidden_size"]):
        raise UserError(f"config.target_hidden_size={raw['target_hidden_size']}: the EAGLE-3 head here needs the target's "
                        f"hidden size equal to its own ({expect['hidden_size']})")
    V = int(_need(c, "vocab_size", where))
    Vd = int(raw.get("draft_vocab_size") or V)
    L = target.num_layers
    if fmt == "speculators":
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]  # speculators' default
        taps = our_layer_ids(ids, "speculators", "eagle_aux_hidden_state_layer_ids")
        state = _rename_in({k: v for k, v in state.items() if not k.startswith("verifier_")},  # the verifier's copies
                           lambda k: k.replace("layers.0.", "midlayer.", 1))
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        k = int(methods[0].get("speculative_tokens") or 3)
    else:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        # without ids SGLang captures the inputs of layers [2, L//2, L-3]: the hidden_states numbering
        taps = our_layer_ids(ids, "sglang") if ids else our_layer_ids([2, L // 2, L - 3], "speculators")
        k = None  # a serving setting in SGLang (--speculative-num-steps), not part of the checkpoint
    state.setdefault("embed_tokens.weight", target.embed_tokens().weight.detach().float())
    if "lm_head.weight" not in state and Vd == V:
        state["lm_head.weight"] = target.lm_head().weight.detach().float()
    if "d2t" not in state and "t2d" not in state and Vd == V:
        state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    for name in ("d2t", "t2d"):
        if name not in state:
            raise UserError(f"model.safetensors: missing {name!r} (draft_vocab_size={Vd} < vocab_size={V} needs the vocabulary map)")
    if int(state["t2d"].bool().sum()) != Vd:
        raise UserError(f"model.safetensors: t2d marks {int(state['t2d'].bool().sum())} tokens, draft_vocab_size is {Vd}")
    state["t2d"] = state["t2d"].bool()
    state["d2t"] = state["d2t"].long()
    cfg = _base(raw.get("draftsmith") or {}, "eagle3", "models.heads.eagle3.Eagle3Head")
    if k is not None or "ttt_steps" not in cfg["init_args"]:
        cfg["init_args"]["ttt_steps"] = k or 7
    cfg["init_args"].update(draft_vocab_size=Vd, num_heads=expect["num_attention_heads"],
                            num_kv_heads=expect["num_key_value_heads"], intermediate_size=expect["intermediate_size"],
                            rope_theta=expect["rope_theta"], rms_eps=expect["rms_norm_eps"])
    expect.update(vocab_size=V, draft_vocab_size=Vd)
    return cfg | {"family": "eagle3", "tap_layers": taps, "expect": expect, "where": where}, state


def _dflash_import(fmt: str, raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    if fmt == "speculators":
        family, c, where = raw["speculators_model_type"], raw.get("transformer_layer_config"), "transformer_layer_config"
        if not isinstance(c, dict):
            raise UserError("config: missing field 'transformer_layer_config'")
        ids = _need(raw, "aux_hidden_state_layer_ids", "config")
        taps = our_layer_ids(ids, "speculators", "aux_hidden_state_layer_ids")
        block, mask_id = int(_need(raw, "block_size", "config")), _need(raw, "mask_token_id", "config")
        want_anchor = family == "dspark"
        if bool(raw.get("sample_from_anchor", want_anchor)) != want_anchor:
            raise UserError(f"config.sample_from_anchor={raw.get('sample_from_anchor')}: the {family} head here "
                            f"{'predicts from' if want_anchor else 'does not predict from'} the anchor slot")
    else:
        family, c, where = "dflash", raw, "config"
        dc = raw.get("dflash_config") or {}
        taps = our_layer_ids(_need(dc, "target_layer_ids", "config.dflash_config"), "dflash")
        block, mask_id = int(raw.get("block_size") or _need(dc, "block_size", "config")), _need(dc, "mask_token_id", "config.dflash_config")
        if raw.get("num_target_layers") not in (None, target.num_layers):
            raise UserError(f"config.num_target_layers={raw['num_target_layers']}, but the target has {target.num_layers} layers")
    expect = _arch_expect(c, where)
    V = int(_need(c, "vocab_size", where))
    if int(raw.get("draft_vocab_size") or V) != V:
        raise UserError(f"config.draft_vocab_size={raw['draft_vocab_size']}: the {family} head here predicts over the "
                        f"full target vocabulary ({V})")
    cls = {"dflash": "models.heads.dflash.DFlashHead", "dspark": "models.heads.dspark.DSparkHead"}[family]
    cfg = _base(raw.get("draftsmith") or {}, family, cls)
    cfg["init_args"].update(block_size=block, num_layers=int(_need(c, "num_hidden_layers", where)), mask_token_id=int(mask_id),
                            rms_eps=expect["rms_norm_eps"])
    if "layers.0.self_attn.q_norm.weight" in state:
        head_cls = _class(cfg["class"])
        if "qk_norm" not in inspect.signature(head_cls.__init__).parameters:
            raise UserError(f"this {family} checkpoint's layers apply per-head q/k RMSNorm (layers.N.self_attn.q_norm), "
                            f"which the {family} head here ({cfg['class']}) does not have")
        cfg["init_args"]["qk_norm"] = True
    if family == "dspark":
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise UserError(f"config.markov_head_type={raw['markov_head_type']!r}: the DSpark head here has the vanilla Markov head")
        if not raw.get("enable_confidence_head", True) or not raw.get("confidence_head_with_markov", True):
            raise UserError("config.enable_confidence_head / confidence_head_with_markov: the DSpark head here has a confidence "
                            "head on [hidden; Markov embedding]")
        rank = int(_need(raw, "markov_rank", "config"))
        if rank <= 0:
            raise UserError(f"config.markov_rank={rank}: the DSpark head here needs a Markov head (rank > 0)")
        cfg["init_args"]["markov_rank"] = rank
        expect["markov_rank"] = rank
        names = {"markov_head.markov_w1.weight": "markov_in.weight", "markov_head.markov_w2.weight": "markov_out.weight",
                 "confidence_head.proj.weight": "confidence.weight", "confidence_head.proj.bias": "confidence.bias"}
        state = _rename_in(state, lambda k: names.get(k, k))
    for k in [k for k in state if k.startswith(("verifier_", "t2d", "d2t"))]:
        del state[k]  # speculators' verifier copies (rebuilt from the target by every reader)
    state.setdefault("embed_tokens.weight", target.embed_tokens().weight.detach().float())
    state.setdefault("lm_head.weight", target.lm_head().weight.detach().float())
    expect.update(vocab_size=V, num_hidden_layers=cfg["init_args"]["num_layers"])
    return cfg | {"family": family, "tap_layers": taps, "expect": expect, "where": where}, state


def _mtp_import(raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    from models.target import default_tap_layers

    where = "transformer_layer_config"
    c = raw.get(where)
    if not isinstance(c, dict):
        raise UserError("config: missing field 'transformer_layer_config'")
    if c.get("model_type") != "qwen3":
        raise UserError(f"{where}.model_type={c.get('model_type')!r}: the MTP head here has a Qwen3 layer "
                        f"(hybrid or MoE MTP layers, e.g. qwen3_next or qwen3_5, are not supported)")
    if int(raw.get("num_nextn_predict_layers", 1)) != 1:
        raise UserError(f"config.num_nextn_predict_layers={raw['num_nextn_predict_layers']}: speculators' MTP has one layer")
    expect = _arch_expect(c, where)
    n = int(_need(c, "num_hidden_layers", where))  # the hidden_states index the draft reads (see _mtp_speculators)
    if our_layer_ids([n], "speculators", f"{where}.num_hidden_layers")[0] != target.num_layers - 1:
        raise UserError(f"{where}.num_hidden_layers={n}: speculators' MTP reads hidden_states[{n}], but the MTP head here "
                        f"reads the target's final-norm output, hidden_states[{target.num_layers}]")
    V = int(_need(c, "vocab_size", where))
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    depths = int(methods[0].get("speculative_tokens") or 3)
    inv = {v: k for k, v in MTP_NAMES.items()}

    def rename(k: str) -> str:
        if not k.startswith("mtp_layers.0."):
            return k  # anything else is reported by check_import
        part, _, rest = k.removeprefix("mtp_layers.0.").partition(".")
        return f"layers.0.{inv[part]}.{rest}" if part in inv else f"layers.0.block.{k.removeprefix('mtp_layers.0.')}"

    state = _rename_in({k: v for k, v in state.items() if not k.startswith(("verifier_", "t2d", "d2t", "embed_tokens", "lm_head"))},
                       rename)
    state["embed_tokens.weight"] = target.embed_tokens().weight.detach().float()  # speculators always uses the verifier's
    state["lm_head.weight"] = target.lm_head().weight.detach().float()
    own = raw.get("draftsmith") or {}
    cfg = _base(own, "mtp", "models.heads.mtp.MTPHead")
    args = cfg["init_args"]
    if args.get("num_modules", depths) != depths:
        args["loss_weights"] = None  # one weight per depth: the recorded ones were for another count
    args.update(num_modules=depths, shared_module=True, qk_norm=True, chain_normed=True, rms_eps=expect["rms_norm_eps"])
    taps = own.get("tap_layers") if own.get("family") == "mtp" else None  # unused by MTP; kept for a faithful round trip
    taps = taps or default_tap_layers(target.num_layers, _class(cfg["class"]).tap_method)
    expect["vocab_size"] = V
    return cfg | {"family": "mtp", "tap_layers": taps, "expect": expect, "where": where}, state


class _Named(dict):
    """A state dict in our names that remembers each tensor's name in the file (for error messages)."""
    file_names: dict[str, str]


def _rename_in(state: dict, fn: Callable[[str], str]) -> dict:
    out = _Named({fn(k): v for k, v in state.items()})
    out.file_names = {fn(k): getattr(state, "file_names", {}).get(k, k) for k in state}
    return out


def _class(path: str) -> type:
    import importlib

    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def import_draft(path: str | Path, target: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """A serving-format directory → (our draft config, state dict in our names) for ``load_draft``.

    The config's ``expect`` entry holds what the format fixes but our constructors derive from the target
    (heads, head size, RoPE base, ...); :func:`check_import` compares them with the built head."""
    path = Path(path)
    fmt = detect_format(path)
    raw = _read_json(path / "config.json")
    state = _load_tensors(path)
    if fmt == "speculators":
        kind = raw.get("speculators_model_type")
        if kind == "eagle3":
            cfg, state = _eagle3_import(fmt, raw, state, target)
        elif kind in ("dflash", "dspark"):
            cfg, state = _dflash_import(fmt, raw, state, target)
        elif kind == "mtp":
            cfg, state = _mtp_import(raw, state, target)
        else:
            why = CANNOT.get(("speculators", str(kind)))
            raise UserError(f"{path}: speculators_model_type={kind!r} cannot be imported"
                            f"{f' ({why})' if why else ''}; importable: eagle3, dflash, dspark, mtp")
    elif fmt == "sglang":
        cfg, state = _eagle3_import(fmt, raw, state, target)
    elif fmt == "dflash":
        cfg, state = _dflash_import(fmt, raw, state, target)
    else:
        raise UserError(f"{path}: not a speculators, SGLang EAGLE-3 or z-lab DFlash directory")
    if not cfg.get("target"):
        tid = target.identity()
        cfg["target"] = {**tid, "hidden_size": cfg["expect"]["hidden_size"], "vocab_size": cfg["expect"]["vocab_size"]}
    cfg["source"] = {"format": fmt, "path": str(path)}
    return cfg, state


def check_import(head: Any, cfg: dict, state: dict[str, torch.Tensor]) -> None:
    """The built head against what the imported config fixes, and every tensor's shape (one line naming the field)."""
    dims, where = head_dims(head), cfg.get("where", "config")
    for key, want in cfg["expect"].items():
        have = dims.get(key)
        if have is None:
            continue
        same = math.isclose(have, want, rel_tol=1e-6) if isinstance(want, float) else have == want
        if not same:
            field = key if key in ("vocab_size", "draft_vocab_size", "markov_rank") else f"{where}.{key}"
            raise UserError(f"{cfg['source']['path']}: {field}={want}, but the {head.family} head built on this target has "
                            f"{have} (it takes this from the target, {head.target_identity.get('name_or_path')!r})")
    mine = head.state_dict()
    for k, v in state.items():
        if k in mine and tuple(mine[k].shape) != tuple(v.shape):
            raise UserError(f"{cfg['source']['path']}/model.safetensors: {getattr(state, 'file_names', {}).get(k, k)} "
                            f"has shape {list(v.shape)}, "
                            f"the config implies {list(mine[k].shape)}")
    missing = sorted(set(mine) - set(state))
    unexpected = sorted(set(state) - set(mine))
    if missing or unexpected:
        raise UserError(f"{cfg['source']['path']}/model.safetensors does not match the {head.family} head: "
                        f"missing {missing[:3]}, unexpected {unexpected[:3]}")
