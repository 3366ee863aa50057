"""``python -m train.ship``: a trained draft made fit to ship inside the repository, with its report.

    python -m train.ship src=runs/smollm2-eagle3 out=assets/smollm2-eagle3 evaluation=runs/smollm2-eval/results.json

Writes ``out/`` atomically: the draft in our own format (what ``python -m eval`` loads) with its floating weights
in ``dtype`` (bfloat16 halves it; frozen copies of the target's tensors are never stored), the resolved training
config, and ``report.json``: the recipe (the training command's config), the run's ``result.json`` (steps, tokens,
training time, validation metrics per the best checkpoint), the validation curve from the run's CSV log, the run it
started from when it was trained with ``init_from=``, and, when given, the evaluation it was measured with
(``python -m eval``'s results.json).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from data.datamodule import cache_dirs
from data.errors import UserError, atomic_dir, cli, guard_out, read_json, run_main, write_json
from train.card import write_card

SHIPPED_FILES = {"config.json", "model.safetensors", "train_config.json", "report.json", "README.md"}  # what out/ holds


def is_shipped(path: Path) -> bool:
    """A folder this command wrote (it is replaced as a whole): only shipped files, with report.json, or an
    export of ours."""
    from train.export import is_our_export

    names = {p.name for p in path.iterdir()}
    return (names <= SHIPPED_FILES and {"report.json", "config.json"} <= names) or is_our_export(path)


def read_evaluation(path: str | Path) -> dict:
    """``python -m eval``'s results.json (a dict with ``protocol`` and ``results``), or one UserError naming it."""
    ev = Path(path).expanduser()
    if not ev.is_file():
        raise UserError(f"evaluation={path}: no such results.json (write one with `python -m eval ...`)")
    try:
        obj = read_json(ev)
    except UnicodeDecodeError:
        raise UserError(f"evaluation={path}: not a text file (give the results.json `python -m eval` wrote)") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("results"), dict) or not isinstance(obj.get("protocol"), dict):
        raise UserError(f"evaluation={path}: not a results.json of `python -m eval` (no protocol and results)")
    return obj


def validation_curve(run_dir: Path) -> list[dict]:
    """``val/acc_len`` (and step) at every validation of the run, from its CSV logs (resumed runs included)."""
    rows = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("val/acc_len"):
                    rows.append({"step": int(float(r["step"])), "val/acc_len": round(float(r["val/acc_len"]), 4)})
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def training_summary(run_dir: Path) -> dict:
    """The run's ``result.json`` without its paths (steps, tokens, time, validation metrics); {} without one."""
    p = run_dir / "result.json"
    result = json.loads(p.read_text()) if p.exists() else {}
    return {k: v for k, v in result.items() if k not in ("run_dir", "best_checkpoint", "export")}


def started_from(init_from: str) -> dict:
    """What a run that began from ``init_from=`` (an exported draft) started with: that run's training summary and
    validation curve, from a shipped folder's report.json or the run directory holding the export."""
    p = Path(init_from)
    if (p / "report.json").exists():
        r = json.loads((p / "report.json").read_text())
        return {"init_from": init_from, "training": r.get("training", {}), "validation_curve": r.get("validation_curve", []),
                **({"started_from": r["started_from"]} if "started_from" in r else {})}
    run = p.parent if p.name == "draft" else p
    return {"init_from": init_from, "training": training_summary(run), "validation_curve": validation_curve(run)}


def ship(src: str | Path, out: str | Path, dtype: str = "bfloat16", evaluation: str | None = None,
         overwrite: bool = False) -> dict:
    """Write ``out/`` (the draft and report.json) in one atomic folder: a refused or failed ship leaves ``out``
    as it was. Refused before any work: an ``out`` that is not a shipped folder of ours (unless ``overwrite``),
    the source or a folder around it, an unwritable place, a bad ``evaluation`` file."""
    from models.formats import load_draft, read_draft_config, resolve_draft_dir
    from models.target import DTYPES, FrozenTarget

    run_dir = Path(src).expanduser()
    draft = resolve_draft_dir(run_dir)
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    out = guard_out(out, "out", is_shipped, sources=[run_dir, draft], overwrite=overwrite, what="a shipped draft of ours")
    evaluated = read_evaluation(evaluation) if evaluation else None
    cfg = read_draft_config(draft)
    target = FrozenTarget(cfg["target"]["name_or_path"], dtype="float32")
    head = load_draft(draft, target)
    train_config = json.loads((draft / "train_config.json").read_text()) if (draft / "train_config.json").exists() else None
    report = {"draft": str(draft), "family": head.family, "target": cfg["target"], "tap_layers": cfg["tap_layers"],
              "stored_dtype": dtype, "trainable_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
              "stored_parameters": sum(v.numel() for k, v in head.state_dict().items() if k not in head.target_copies()),
              "training": training_summary(run_dir),
              "validation_curve": validation_curve(run_dir)}
    if (train_config or {}).get("init_from"):  # continued training: the run it started from, and the token-passes of both
        report["started_from"] = started_from(str(train_config["init_from"]))
        prev = report["started_from"]["training"]  # a chain of continued runs: what the one before had already summed
        before = prev.get("train_tokens_including_init", prev.get("train_tokens"))
        if before is not None and "train_tokens" in report["training"]:
            report["training"]["train_tokens_including_init"] = before + report["training"]["train_tokens"]
    data_cfg = (train_config or {}).get("data") or {}
    if data_cfg.get("feature_dir"):  # what the head was trained on: the offline caches' splits (samples, tokens)
        report["features"] = {}
        for split, dirs in (("train", cache_dirs(data_cfg["feature_dir"])),
                            ("heldout", cache_dirs(data_cfg.get("val_feature_dir")) or cache_dirs(data_cfg["feature_dir"]))):
            shards = [x for d in dirs for m in sorted(Path(d, split).glob("manifest-r*.json"))
                      for x in json.loads(m.read_text())["shards"]]
            report["features"][split] = {"samples": sum(x["samples"] for x in shards), "tokens": sum(x["tokens"] for x in shards),
                                         "caches": dirs}
        report["data_source"] = train_config["data"].get("source")
    if evaluated is not None:
        report["evaluation"] = evaluated
    with atomic_dir(out) as tmp:  # the draft and its report appear together, or not at all
        inner = head.export(tmp / "draft", train_config=train_config, dtype=DTYPES[dtype])
        for p in inner.iterdir():
            p.rename(tmp / p.name)
        inner.rmdir()
        write_json(tmp / "report.json", report)
        write_card(tmp, shown_as=out)  # README.md: the model card, from the report, naming the folder it becomes
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"shipped {draft} -> {out} ({size / 1e6:.1f} MB, {report['stored_parameters']:,} parameters in {dtype})")
    return report


@hydra.main(config_path="../conf", config_name="ship", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    if not cfg.src or not cfg.out:
        raise UserError("give src=<run dir> and out=<folder>, e.g. src=runs/smollm2-eagle3 out=assets/smollm2-eagle3")
    ship(cfg.src, cfg.out, cfg.dtype, cfg.evaluation, bool(cfg.get("overwrite")))


if __name__ == "__main__":
    run_main(main)
