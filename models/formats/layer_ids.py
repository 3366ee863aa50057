"""Layer ids: the one conversion between our tap layers and what each serving engine writes.

Engines disagree on how to number the target layers a draft reads. We, SGLang's ``eagle_config`` and z-lab's
``dflash_config`` name the *output* of decoder layer i (Hugging Face ``hidden_states[i + 1]``); speculators and
vLLM name the index into ``hidden_states``, i.e. the *input* of layer i (vLLM's own DFlash reader subtracts one,
see vllm#40727). Built on :func:`models.target.hf_hidden_index`.

Both engines collect a listed layer's state as the residual stream entering a decoder layer (vLLM:
``hidden_states + residual`` before layer id; SGLang: the same before layer id + 1 of its ``output`` id), so our tap
``L - 1`` (the last layer's output, speculators id ``L``) is collected by neither: heads that read taps never use it
(:func:`models.target.check_collectable`, refused by :func:`models.formats.load_draft` and so by every export).
"""
from __future__ import annotations

from data.errors import UserError
from models.target import hf_hidden_index

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
