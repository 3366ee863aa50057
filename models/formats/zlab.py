"""z-lab's DFlash layout (``format=dflash``), which SGLang serves with ``--speculative-algorithm DFLASH``: a
Qwen3-style config plus ``block_size``, ``num_target_layers`` and ``dflash_config {mask_token_id,
target_layer_ids}``; weights in our names without the embedding and head (the target's). Layer ids name
decoder-layer outputs, as ours (:mod:`models.formats.layer_ids`)."""
from __future__ import annotations

from typing import Any

from data.errors import UserError
from models.formats.common import (block_body, block_finish, head_dims, layer_config, need, rename_in, renamed,
                                   require_full_vocab, require_qk_norm)
from models.formats.layer_ids import engine_layer_ids, our_layer_ids

NAME = "dflash"


def detect(raw: dict) -> bool:
    return "dflash_config" in raw or any("DFlash" in str(a) for a in raw.get("architectures") or [])


def family_of(raw: dict) -> str:
    return "dflash"


def verifier_of(raw: dict) -> str | None:
    return None


def _dflash_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    require_qk_norm(head, NAME)
    require_full_vocab(head, NAME)
    if head.first_slot == 0:
        raise UserError("format=dflash cannot hold this draft: z-lab's DFlash predicts the first token from a MASK slot, "
                        "this one from the anchor slot (draft.anchor_slot); export it with format=speculators")
    d = head_dims(head)
    cfg = {"architectures": ["DFlashDraftModel"], **layer_config("qwen3", d, tc, d["num_hidden_layers"], dtype),
           "block_size": head.block_size, "num_target_layers": int(tc.num_hidden_layers),
           "dflash_config": {"mask_token_id": head.mask_token_id, "target_layer_ids": engine_layer_ids(head.tap_layers, NAME)}}
    return cfg, renamed(head.state_dict(), block_body)


EXPORT = {"dflash": _dflash_export}


def import_raw(raw: dict, state: dict, target: Any, path: Any) -> tuple[dict, dict]:
    dc = raw.get("dflash_config") or {}
    taps = our_layer_ids(need(dc, "target_layer_ids", "config.dflash_config"), NAME)
    block = int(raw.get("block_size") or need(dc, "block_size", "config"))
    mask_id = need(dc, "mask_token_id", "config.dflash_config")
    if raw.get("num_target_layers") not in (None, target.num_layers):
        raise UserError(f"config.num_target_layers={raw['num_target_layers']}, but the target has {target.num_layers} layers")
    return block_finish(raw, raw, "config", rename_in(state, lambda k: k), target, "dflash", taps, block, mask_id)
