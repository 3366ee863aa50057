"""``python -m train.export``: ship a trained draft to a serving engine (format chosen by config).

    python -m train.export src=runs/eagle3-embedded                          # vLLM speculators format
    python -m train.export src=runs/eagle3-embedded format=sglang            # SGLang EAGLE-3
    python -m train.export src=runs/dflash/draft format=dflash out=dflash-z   # z-lab DFlash (SGLang --speculative-algorithm DFLASH)
    python -m train.export src=runs/x verifier=meta-llama/Llama-3.1-8B-Instruct dtype=bfloat16

The draft is rebuilt on its target (``verifier``, or the target it records), converted by
:mod:`models.formats` (parameter names, layer-id convention, engine config) and written atomically:
a refused or failed export leaves no directory behind. ``load_draft`` (and so ``python -m eval``) reads
every format this writes. ``python -m eval.check_export drafts=[runs/x]`` checks a trained draft's speculators
export against the speculators library and our import, on real text through its target.
"""
from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from data.errors import UserError, cli, run_main
from train.card import write_card
from train.rundir import sweep_leftovers

EXPORT_FILES = {"config.json", "model.safetensors", "train_config.json", "README.md"}  # what our exports (and run_dir/draft) hold


def is_our_export(path: Path) -> bool:
    """A directory this project wrote as an export: only export files, and a config.json that says so."""
    names = {p.name for p in path.iterdir()}
    if not names <= EXPORT_FILES or "config.json" not in names:
        return False
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and ("draftsmith" in cfg or str(cfg.get("format", "")).startswith("draftsmith"))


def check_out(out: Path, overwrite: bool) -> None:
    """``out=`` is replaced as a whole: refuse one that exists and is not an export of ours (unless ``overwrite=true``)."""
    out = out.expanduser()
    here = Path.cwd().resolve()
    if out.exists() or out.is_symlink():
        if out.is_symlink() or not out.is_dir():
            raise UserError(f"out={out}: exists and is not a directory; choose another out=")
        if here == out.resolve() or here.is_relative_to(out.resolve()):
            raise UserError(f"out={out}: would replace the working directory; choose another out=")
        if any(out.iterdir()) and not is_our_export(out) and not overwrite:
            held = sorted(p.name for p in out.iterdir())
            raise UserError(f"out={out}: exists and is not an export of ours (holds {', '.join(held[:4])}"
                            f"{', ...' if len(held) > 4 else ''}); choose another out= or pass overwrite=true to replace it")


def run(cfg: DictConfig) -> dict:
    from models.formats import draft_family, export_draft, resolve_draft_dir

    if not cfg.get("src"):
        raise UserError("src: give a run directory or an exported draft (src=runs/<name>)")
    out = cfg.out or f"{str(cfg.src).rstrip('/')}-{cfg.format}"
    check_out(Path(out), bool(cfg.get("overwrite")))
    sweep_leftovers(Path(out).expanduser().parent, names=[Path(out).name])  # of an export killed mid-write
    path = export_draft(cfg.src, cfg.format, out, verifier=cfg.verifier, dtype=cfg.dtype)
    src = resolve_draft_dir(cfg.src)
    write_card(path, src=src)  # README.md: the model card
    exported = json.loads((Path(path) / "config.json").read_text())
    result = {"draft": str(src), "family": draft_family(src)[0], "format": cfg.format, "out": str(path),
              "files": sorted(p.name for p in Path(path).iterdir())}
    for key in ("speculators_model_type", "architectures", "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids",
                "eagle_config", "dflash_config"):
        if key in exported:
            result[key] = exported[key]
    print(json.dumps(result, indent=2))
    return result


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    run_main(main)
