"""vLLM's format, defined by the ``speculators`` library (0.9.0).

``config.json`` with ``speculators_model_type``, ``architectures``, ``speculators_version``, ``speculators_config``
(algorithm, proposal methods, verifier) and ``transformer_layer_config``; ``model.safetensors`` named as that
library's model classes name their parameters. Families (:data:`FAMILIES`, one row each): EAGLE-3
(``Eagle3DraftModel``), DFlash (``DFlashDraftModel``), DSpark (``DSparkDraftModel``), MTP (``MTPDraftModel``: one
Qwen3 layer reused at every depth and fed its own normed output; only an MTP head built in that layout,
``draft=mtp_speculators``). Layer ids are ``hidden_states`` indices (:mod:`models.formats.layer_ids`).

Each row also says how ``python -m eval.check_export`` runs speculators' forward on the family: which inputs it
takes, which of our logits it must reproduce, which config fields it must read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from data.errors import UserError
from models.formats.common import (block_body, block_finish, eagle3_finish, head_dims, layer_config, layer_config_of, need,
                                   base_config, head_class, arch_expect, rename_in, renamed, require_qk_norm)
from models.formats.layer_ids import engine_layer_ids, our_layer_ids
from models.heads.eagle3 import VARIANTS

NAME = "speculators"
VERSION = "0.9.0"  # the speculators release whose model classes define the names used here
# speculators' MTPDraftModel names (mtp_layers.0.<its name>) for our MTPModule parts; the block's own parts keep theirs
MTP_NAMES = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj", "norm": "final_layernorm"}
DSPARK_NAMES = {"markov_in.weight": "markov_head.markov_w1.weight", "markov_out.weight": "markov_head.markov_w2.weight",
                "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}


def detect(raw: dict) -> bool:
    return "speculators_model_type" in raw


def family_of(raw: dict) -> str:
    return str(raw.get("speculators_model_type"))


def verifier_of(raw: dict) -> str | None:
    return ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def _envelope(algorithm: str, arch: str, speculative_tokens: int, verifier: dict) -> dict:
    return {"architectures": [arch], "speculators_model_type": algorithm, "speculators_version": VERSION,
            "speculators_config": {"algorithm": algorithm,
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "default_proposal_method": "greedy", "verifier": verifier}}


def _speculative_tokens(raw: dict) -> int:
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)


# -- EAGLE-3 ------------------------------------------------------------------------------------------------
def _eagle3_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    cfg = _envelope("eagle3", "Eagle3Speculator", head.ttt_steps, verifier)
    layer = layer_config("llama", d, tc, 1, dtype)
    window = getattr(head, "sliding_window", None)
    if window is not None:  # speculators' sliding-window layer (its trainer's default)
        layer.update(sliding_window=window, use_sliding_window=True, layer_types=["sliding_attention"])
    cfg.update(transformer_layer_config=layer, draft_vocab_size=d["draft_vocab_size"],
               norm_before_residual=bool(getattr(head, "norm_before_residual", False)),
               norm_before_fc=getattr(head, "input_norm", None) is not None, fc_norm=False,
               norm_output=bool(getattr(head, "norm_output", False)), embed_requires_grad=False, target_hidden_size=None,
               eagle_aux_hidden_state_layer_ids=engine_layer_ids(head.tap_layers, NAME))
    # speculators saves EAGLE-3 drafts with their (frozen) embedding, and its loader relies on it being there:
    # without it from_pretrained leaves a freshly initialised table instead of the verifier's
    full_vocab = d["draft_vocab_size"] == d["vocab_size"]  # speculators keeps no d2t/t2d then
    state = renamed(head.state_dict(), lambda k: None if full_vocab and k in ("d2t", "t2d")
                    else k.replace("midlayer.", "layers.0.", 1))
    return cfg, state


def _eagle3_import(raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    where = "transformer_layer_config"
    c = layer_config_of(raw)
    L = target.num_layers
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]  # speculators' default
    taps = our_layer_ids(ids, NAME, "eagle_aux_hidden_state_layer_ids")
    state = rename_in({k: v for k, v in state.items() if not k.startswith("verifier_")},  # the verifier's copies
                      lambda k: k.replace("layers.0.", "midlayer.", 1))
    variants = _eagle3_variants(raw, c, where)
    plain = {k: v for k, v in raw.items() if k not in ("norm_before_fc", "norm_before_residual", "norm_output")}
    if "sliding_window" in variants:  # read above: the rest of the layer config is checked as a full-attention one
        c = {k: v for k, v in c.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    cfg, state = eagle3_finish(plain, c, where, state, target, taps, _speculative_tokens(raw))
    for k in VARIANTS:
        cfg["init_args"].pop(k, None)  # what the checkpoint says, not what a recorded config said
    cfg["init_args"].update(variants)
    return cfg, state


def _eagle3_variants(raw: dict, c: dict, where: str) -> dict:
    """The head options (:class:`models.heads.eagle3.Eagle3Head`) for speculators' EAGLE-3 variants: its trainer's
    defaults are ``norm_before_fc``, ``norm_before_residual``, ``norm_output`` and a sliding-window layer."""
    if raw.get("fc_norm"):
        raise UserError("config.fc_norm=true: the EAGLE-3 head here has no per-tap norms before fc (norm_before_fc, one "
                        "norm over the concatenated taps, it has)")
    out = {k: True for k in ("norm_before_fc", "norm_before_residual", "norm_output") if raw.get(k)}
    types = c.get("layer_types") or []
    if types and types[0] not in ("sliding_attention", "full_attention"):
        raise UserError(f"{where}.layer_types={types}: the EAGLE-3 head here has full or sliding-window attention")
    sliding = types[0] == "sliding_attention" if types else bool(c.get("use_sliding_window") and c.get("sliding_window"))
    if sliding:
        out["sliding_window"] = int(need(c, "sliding_window", where))
    return out


# -- DFlash / DSpark ----------------------------------------------------------------------------------------
def _block_export(head: Any, tc: Any, verifier: dict, dtype: str, arch: str) -> tuple[dict, dict]:
    """Shared by DFlash and DSpark: a block drafts ``max_draft`` tokens, from the anchor's slot on when
    ``first_slot`` is 0 (speculators' ``sample_from_anchor``), over the draft vocabulary where there is one."""
    require_qk_norm(head, NAME)
    d = head_dims(head)
    cfg = _envelope(head.family, arch, head.max_draft, verifier)
    cfg.update(transformer_layer_config=layer_config("qwen3", d, tc, d["num_hidden_layers"], dtype),
               draft_vocab_size=head.draft_vocab_size or d["vocab_size"], block_size=head.block_size, target_hidden_size=None,
               aux_hidden_state_layer_ids=engine_layer_ids(head.tap_layers, NAME),
               mask_token_id=head.mask_token_id, sliding_window_non_causal=False, sample_from_anchor=head.first_slot == 0)
    # a draft vocabulary: its head rows serialised as lm_head (speculators cannot derive them), beside d2t/t2d
    return cfg, renamed(head.state_dict(), lambda k: "lm_head.weight" if k == "draft_head.weight" else DSPARK_NAMES.get(k, block_body(k)))


def _dflash_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    return _block_export(head, tc, verifier, dtype, "DFlashSpeculator")


def _dspark_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    cfg, state = _block_export(head, tc, verifier, dtype, "DSparkSpeculator")
    cfg.update(markov_rank=head_dims(head)["markov_rank"], markov_head_type="vanilla", enable_confidence_head=True,
               confidence_head_with_markov=True)
    return cfg, state


def _block_import(raw: dict, state: dict, target: Any, anchor: bool) -> tuple[dict, dict]:
    family, c, where = family_of(raw), layer_config_of(raw), "transformer_layer_config"
    taps = our_layer_ids(need(raw, "aux_hidden_state_layer_ids", "config"), NAME, "aux_hidden_state_layer_ids")
    block, mask_id = int(need(raw, "block_size", "config")), need(raw, "mask_token_id", "config")
    if bool(raw.get("sample_from_anchor", anchor)) != anchor:
        raise UserError(f"config.sample_from_anchor={raw.get('sample_from_anchor')}: the {family} head here "
                        f"{'predicts from' if anchor else 'does not predict from'} the anchor slot")
    return block_finish(raw, c, where, state, target, family, taps, block, mask_id)


def _dflash_import(raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    anchor = bool(raw.get("sample_from_anchor", False))  # DeepSpec's DFlash baseline: draft.anchor_slot
    cfg, state = _block_import(raw, state, target, anchor=anchor)
    if anchor:
        cfg["init_args"]["anchor_slot"] = True
    return cfg, state


def _dspark_import(raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    cfg, state = _block_import(raw, state, target, anchor=True)
    if raw.get("markov_head_type", "vanilla") != "vanilla":
        raise UserError(f"config.markov_head_type={raw['markov_head_type']!r}: the DSpark head here has the vanilla Markov head")
    if not raw.get("enable_confidence_head", True) or not raw.get("confidence_head_with_markov", True):
        raise UserError("config.enable_confidence_head / confidence_head_with_markov: the DSpark head here has a confidence "
                        "head on [hidden; Markov embedding]")
    rank = int(need(raw, "markov_rank", "config"))
    if rank <= 0:
        raise UserError(f"config.markov_rank={rank}: the DSpark head here needs a Markov head (rank > 0)")
    cfg["init_args"]["markov_rank"] = rank
    cfg["expect"]["markov_rank"] = rank
    inv = {v: k for k, v in DSPARK_NAMES.items()}
    return cfg, rename_in(state, lambda k: inv.get(k, k))


# -- MTP ------------------------------------------------------------------------------------------------------
def _mtp_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    differs = [why for bad, why in ((d["num_modules"] != 1, f"{d['num_modules']} modules (shared_module)"),
                                    (not d["qk_norm"], "no q/k norms (qk_norm)"),
                                    (not d["chain_normed"], "pre-norm states handed on (chain_normed)")) if bad]
    if differs:
        raise UserError(f"format=speculators cannot hold this mtp draft: speculators' MTP is one Qwen3 layer reused at every "
                        f"depth and fed its own normed output, this draft has {', '.join(differs)}; "
                        f"train it with draft=mtp_speculators")
    cfg = _envelope("mtp", "MTPDraftModel", head.num_steps, verifier)
    # speculators' MTP reads hidden_states[transformer_layer_config.num_hidden_layers]: the target's last layer, whose
    # Hugging Face entry is the final-norm output (our last_state); so the layer config keeps the target's layer count
    last = engine_layer_ids([int(tc.num_hidden_layers) - 1], NAME)[0]
    cfg.update(transformer_layer_config=layer_config("qwen3", d, tc, last, dtype), num_nextn_predict_layers=1)

    def rename(k: str) -> str | None:
        if k in ("embed_tokens.weight", "lm_head.weight") or k in head.decode_only_state:
            return None  # speculators always loads the verifier's (ours are frozen copies); a draft vocabulary only
            # restricts our decoding, and vLLM drafts from the full head
        part, _, rest = k.removeprefix("layers.0.").partition(".")
        return f"mtp_layers.0.{rest}" if part == "block" else f"mtp_layers.0.{MTP_NAMES[part]}.{rest}"

    return cfg, renamed(head.state_dict(), rename)


def _mtp_import(raw: dict, state: dict, target: Any) -> tuple[dict, dict]:
    from models.target import default_tap_layers

    where = "transformer_layer_config"
    c = layer_config_of(raw)
    if c.get("model_type") != "qwen3":
        raise UserError(f"{where}.model_type={c.get('model_type')!r}: the MTP head here has a Qwen3 layer "
                        f"(hybrid or MoE MTP layers, e.g. qwen3_next or qwen3_5, are not supported)")
    if int(raw.get("num_nextn_predict_layers", 1)) != 1:
        raise UserError(f"config.num_nextn_predict_layers={raw['num_nextn_predict_layers']}: speculators' MTP has one layer")
    expect = arch_expect(c, where)
    n = int(need(c, "num_hidden_layers", where))  # the hidden_states index the draft reads (see _mtp_export)
    if our_layer_ids([n], NAME, f"{where}.num_hidden_layers")[0] != target.num_layers - 1:
        raise UserError(f"{where}.num_hidden_layers={n}: speculators' MTP reads hidden_states[{n}], but the MTP head here "
                        f"reads the target's final-norm output, hidden_states[{target.num_layers}]")
    V = int(need(c, "vocab_size", where))
    depths = _speculative_tokens(raw)
    inv = {v: k for k, v in MTP_NAMES.items()}

    def rename(k: str) -> str:
        if not k.startswith("mtp_layers.0."):
            return k  # anything else is reported by check_import
        part, _, rest = k.removeprefix("mtp_layers.0.").partition(".")
        return f"layers.0.{inv[part]}.{rest}" if part in inv else f"layers.0.block.{k.removeprefix('mtp_layers.0.')}"

    state = rename_in({k: v for k, v in state.items() if not k.startswith(("verifier_", "t2d", "d2t", "embed_tokens", "lm_head"))},
                      rename)
    state["embed_tokens.weight"] = target.embed_tokens().weight.detach().float()  # speculators always uses the verifier's
    state["lm_head.weight"] = target.lm_head().weight.detach().float()
    own = raw.get("draftsmith") or {}
    cfg = base_config(own, "mtp")
    args = cfg["init_args"]
    if args.get("num_modules", depths) != depths:
        args["loss_weights"] = None  # one weight per depth: the recorded ones were for another count
    args.update(num_modules=depths, shared_module=True, qk_norm=True, chain_normed=True, rms_eps=expect["rms_norm_eps"],
                draft_vocab_size=None)  # the format holds no draft vocabulary: the imported head drafts from the full head
    taps = own.get("tap_layers") if own.get("family") == "mtp" else None  # unused by MTP; kept for a faithful round trip
    taps = taps or default_tap_layers(target.num_layers, head_class(cfg["class"]).tap_method)
    expect["vocab_size"] = V
    return cfg | {"family": "mtp", "tap_layers": taps, "expect": expect, "where": where}, state


# -- how speculators' forward is checked against ours (python -m eval.check_export) ------------------------------
@torch.no_grad()
def _eagle3_logits(head: Any, target: Any, b: dict, anchors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Every training-time-test step's draft logits, stacked [K, 1, T, Vd]."""
    ids = b["input_ids"]
    feats = target(ids, return_logits=True)
    valid = b.get("attention_mask", torch.ones_like(ids))
    return {"logits": torch.stack([head.logits_of(h) for h in head.unroll(ids, valid, feats, head.ttt_steps)])}


@torch.no_grad()
def _block_logits(head: Any, target: Any, b: dict, anchors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Block logits at ``anchors``, [1, N·blk, V] or over the draft vocabulary [1, N·blk, Vd] where the head has one
    (DSpark: with its Markov bias, plus the confidence logits)."""
    ids = b["input_ids"]
    feats = target(ids, return_logits=True)
    ok = torch.ones(1, anchors.numel(), dtype=torch.bool)
    h = head.block_hidden(ids, anchors[None], ok, feats.tap_states)  # [1, N, blk, d]
    if not hasattr(head, "slot_outputs"):
        return {"logits": head.rows_logits(h).flatten(1, 2)}
    pos = anchors[:, None] + torch.arange(head.block_size)
    logits, conf = head.slot_outputs(h, ids[0, pos][None])
    return {"logits": logits.flatten(1, 2), "confidence": conf.flatten(1)}


@torch.no_grad()
def _mtp_logits(head: Any, target: Any, b: dict, anchors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Every depth's logits [K, 1, T', V] at the positions whose inputs all lie inside the sequence, as speculators
    gives them."""
    ids = b["input_ids"]
    feats = target(ids, return_logits=True)
    logits = torch.stack(list(head.depth_logits(ids, feats.last_state, head.num_steps)))
    return {"logits": logits[:, :, : ids.shape[1] - head.num_steps - 1]}


def _eagle3_inputs(head: Any, ids: torch.Tensor, anchors: torch.Tensor | None) -> dict:
    from models.layers import shift_left

    # speculators feeds step 0 the next token (ours shifts inside the head)
    return {"input_ids": shift_left(ids, 1), "position_ids": torch.arange(ids.shape[1])[None],
            "ttt_steps": torch.tensor(head.ttt_steps)}


def _block_inputs(head: Any, ids: torch.Tensor, anchors: torch.Tensor | None) -> dict:
    return {"anchors": anchors}


def _eagle3_meta(head: Any, target: Any) -> dict:
    return {"layer_ids": engine_layer_ids(head.tap_layers, NAME), "draft_vocab_size": head.draft_vocab_size}


def _block_meta(head: Any, target: Any) -> dict:
    return {"layer_ids": engine_layer_ids(head.tap_layers, NAME), "block_size": head.block_size,
            "mask_token_id": head.mask_token_id}


def _mtp_meta(head: Any, target: Any) -> dict:
    # reads the last layer's output; one shared layer; K depths
    return {"layer_ids": engine_layer_ids([target.num_layers - 1], NAME), "num_nextn_predict_layers": 1,
            "speculative_tokens": head.num_steps}


@dataclass(frozen=True)
class Family:
    """One family in the speculators format: export, import, and how ``eval.check_export`` compares the two sides."""

    model_class: str                       # speculators' model class
    export: Callable[..., tuple[dict, dict]]    # (head, target config, verifier entry, dtype) → (config.json, tensors)
    load: Callable[..., tuple[dict, dict]]      # (raw config, tensors, target) → (our draft config, state in our names)
    logits: Callable[..., dict]            # (head, target, batch, anchors) → our logits speculators must reproduce
    inputs: Callable[..., dict]            # (head, ids, anchors) → forward inputs besides the target's features
    meta: Callable[..., dict]              # (head, target) → config fields speculators must read
    blocks: bool = False                   # drafts blocks at anchors


FAMILIES: dict[str, Family] = {
    "eagle3": Family("Eagle3DraftModel", _eagle3_export, _eagle3_import, _eagle3_logits, _eagle3_inputs, _eagle3_meta),
    "dflash": Family("DFlashDraftModel", _dflash_export, _dflash_import, _block_logits, _block_inputs, _block_meta, True),
    "dspark": Family("DSparkDraftModel", _dspark_export, _dspark_import, _block_logits, _block_inputs, _block_meta, True),
    "mtp": Family("MTPDraftModel", _mtp_export, _mtp_import, _mtp_logits, lambda head, ids, anchors: {}, _mtp_meta),
}
EXPORT = {f: row.export for f, row in FAMILIES.items()}


def import_raw(raw: dict, state: dict, target: Any, path: Any) -> tuple[dict, dict]:
    kind = family_of(raw)
    if kind not in FAMILIES:
        raise UserError(f"{path}: speculators_model_type={raw.get('speculators_model_type')!r} cannot be imported; "
                        f"importable: {', '.join(FAMILIES)}")
    return FAMILIES[kind].load(raw, state, target)
