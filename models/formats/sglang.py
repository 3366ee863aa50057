"""SGLang's EAGLE-3 layout: a ``LlamaForCausalLMEagle3`` config with ``draft_vocab_size`` and ``eagle_config``;
weights ``fc``, ``midlayer``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (our names), no embedding (SGLang uses the
target's). Layer ids name decoder-layer outputs, as ours (:mod:`models.formats.layer_ids`)."""
from __future__ import annotations

from typing import Any

from data.errors import UserError
from models.formats.common import eagle3_finish, head_dims, layer_config, rename_in, renamed
from models.formats.layer_ids import engine_layer_ids, our_layer_ids
from models.heads.eagle3 import VARIANTS

NAME = "sglang"


def detect(raw: dict) -> bool:
    return "eagle_config" in raw or any("Eagle3" in str(a) for a in raw.get("architectures") or [])


def family_of(raw: dict) -> str:
    return "eagle3"


def verifier_of(raw: dict) -> str | None:
    return None


def _eagle3_export(head: Any, tc: Any, verifier: dict, dtype: str) -> tuple[dict, dict]:
    d = head_dims(head)
    if d["num_taps"] != 3:
        raise UserError(f"format=sglang cannot hold this eagle3 draft: SGLang's EAGLE-3 fc reads exactly 3 target layers, "
                        f"this draft reads {d['num_taps']} ({head.tap_layers})")
    variants = [k for k in VARIANTS if head.init_args.get(k)]
    if variants:  # SGLang's LlamaForCausalLMEagle3 has none of them: its layer would compute another function
        raise UserError(f"format=sglang cannot hold this eagle3 draft: SGLang's EAGLE-3 layer has no {', '.join(variants)} "
                        "(speculators' variants); export it with format=speculators (vLLM), or train it with "
                        + " ".join(f"draft.{k}={'null' if k == 'sliding_window' else 'false'}" for k in variants) + " for SGLang")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config("llama", d, tc, 1, dtype),
           "draft_vocab_size": d["draft_vocab_size"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(head.tap_layers, NAME),
                            "use_aux_hidden_state": True}}
    return cfg, renamed(head.state_dict(), lambda k: None if k == "embed_tokens.weight" else k)


EXPORT = {"eagle3": _eagle3_export}


def import_raw(raw: dict, state: dict, target: Any, path: Any) -> tuple[dict, dict]:
    L = target.num_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # without ids SGLang captures the inputs of layers [2, L//2, L-3]: the hidden_states numbering
    taps = our_layer_ids(ids, NAME) if ids else our_layer_ids([2, L // 2, L - 3], "speculators")
    # the draft length is a serving setting in SGLang (--speculative-num-steps), not part of the checkpoint
    return eagle3_finish(raw, raw, "config", rename_in(state, lambda k: k), target, taps, None)
