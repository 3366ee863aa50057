"""Model cards: a ``README.md`` beside every exported or shipped draft, written from what the folder and its run hold.

    python -m train.card path=assets/smollm2-eagle3                       # from the folder's report.json
    python -m train.card path=runs/x-speculators evaluation=runs/eval/results.json drafter=x \\
        "measured='2026-12-06, 2-core AMD EPYC, idle: python -m eval ...'"

A card says what the head drafts for (the target), how it was trained (recipe, data, tokens), what validation measured
(expected acceptance length and per-position acceptance from the run's summary), what decoding measured when an
evaluation is given (τ and speed-up per prompt set and temperature, with the line saying when, where and how), and how
to serve it: the vLLM and SGLang command lines for the families those engines hold (``models.formats.FORMATS``), or
that it is not servable by them. ``python -m train.export`` and ``python -m train.ship`` write one with every export.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from data.errors import UserError, atomic_file, cli, run_main
from data.regenerate import answer_temperature

FAMILY_NAMES = {"eagle3": "EAGLE-3", "eagle": "EAGLE-1", "mtp": "MTP", "medusa": "Medusa", "dflash": "DFlash",
                "dspark": "DSpark"}
SETS = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "sharegpt": "ShareGPT held-out"}
BASELINES = ("plain", "ngram", "draft_model")  # drafters of an evaluation that are not the head
SGLANG_ALGORITHM = {"sglang": "EAGLE3", "dflash": "DFLASH"}  # our format= name -> SGLang's --speculative-algorithm


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e}); write it again or remove it") from None


def folder_facts(folder: Path) -> dict:
    """Family, target, tap layers and format of a draft folder (ours or a serving export carrying our config)."""
    from models.formats import detect_format, draft_family

    raw = _read(folder / "config.json")
    if not raw:
        raise UserError(f"path={folder}: no config.json; give an exported or shipped draft folder")
    fmt = detect_format(folder)
    own = raw.get("draftsmith") or raw
    family, target = draft_family(folder)
    return {"family": family, "target": target, "format": fmt or "draftsmith", "reads": reads(own),
            "init_args": own.get("init_args") or {}, "num_steps": own.get("num_steps")}


def reads(own: dict) -> str:
    """Which target states the head reads: its tap layers, or the final-norm state for heads that read no taps."""
    import importlib

    mod, _, name = str(own.get("class", "")).rpartition(".")
    try:
        taps = getattr(importlib.import_module(mod), name).reads_taps
    except (ImportError, AttributeError, ValueError):
        taps = True
    return f"tap layers {own.get('tap_layers')}" if taps else "the final-norm state"


def run_facts(src: Path) -> dict:
    """What a run left about its head: a shipped folder's report.json, else the run's result.json and train config."""
    src = Path(src)
    if (src / "report.json").exists():
        return _read(src / "report.json")
    run = src.parent if src.name == "draft" else src
    result = _read(run / "result.json")
    training = {k: v for k, v in result.items() if k not in ("run_dir", "best_checkpoint", "export")}
    tc = _read(run / "draft" / "train_config.json") or _read(src / "train_config.json")
    return {"training": training, "train_config": tc}


def serving_target(name: str | None) -> str:
    """The target as a serving engine names it (the embedded target's folder, SmolLM2's hub id)."""
    from models.gguf import SMOLLM2, SMOLLM2_HUB_NAME
    from models.target import EMBEDDED, EMBEDDED_PATH

    if not name:
        return "<target>"
    if name == EMBEDDED:  # the folder in this repository, relative where possible
        path = Path(EMBEDDED_PATH).resolve()
        return str(path.relative_to(Path.cwd().resolve())) if path.is_relative_to(Path.cwd().resolve()) else str(path)
    return {SMOLLM2: SMOLLM2_HUB_NAME}.get(name, name)


def serving_lines(family: str, folder: str, fmt: str, target: str, steps: int | None) -> list[str]:
    """vLLM and SGLang command lines for ``family``; one line saying it is not servable when neither engine holds it."""
    from models.formats import FORMATS

    k = steps or 3
    lines: list[str] = []
    if family in FORMATS["speculators"]:
        spec = folder if fmt == "speculators" else f"{folder}-speculators"
        if fmt != "speculators":
            lines.append(f"python -m train.export src={folder} format=speculators          # writes {spec}")
        lines.append(f"vllm serve {spec}          # vLLM reads the target and the method from its speculators_config")
        if family == "eagle3":
            lines.append(f"vllm serve {target} --speculative-config "
                         f"'{{\"model\": \"{spec}\", \"num_speculative_tokens\": {k}, \"method\": \"eagle3\"}}'")
    for name, algorithm in SGLANG_ALGORITHM.items():
        if family in FORMATS[name]:
            out = folder if fmt == name else f"{folder}-{name}"
            if fmt != name:
                lines.append(f"python -m train.export src={folder} format={name}          # writes {out}")
            extra = f" --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}" \
                if algorithm == "EAGLE3" else ""
            lines.append(f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
                         f"--speculative-draft-model-path {out}{extra}")
    return lines


def pick_drafter(evaluation: dict, drafter: str | None) -> str:
    """The evaluation's drafter that is this head: ``drafter``, or the only one that is not a baseline."""
    names = list(dict.fromkeys(d for per_set in evaluation.get("results", {}).values()
                               for per_t in per_set.values() for d in per_t))
    if drafter:
        if drafter not in names:
            raise UserError(f"drafter={drafter}: not in the evaluation (it holds {', '.join(names)})")
        return drafter
    heads = [n for n in names if n not in BASELINES]
    if len(heads) != 1:
        raise UserError(f"drafter: the evaluation holds {', '.join(heads) or 'no head'}; name the one this card is for "
                        f"(drafter=<name>)")
    return heads[0]


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "–"


def card_text(folder: Path, facts: dict, run: dict, evaluation: dict | None = None, drafter: str | None = None,
              measured: str | None = None, shown_as: Path | None = None) -> str:
    """The card as Markdown (pure: everything it says comes from the arguments); ``shown_as``: the path the card names
    (default ``folder``; a folder written under a temporary name shows its final one)."""
    shown = shown_as or folder
    family = facts["family"]
    target = (run.get("target") or facts["target"] or {}).get("name_or_path")
    tc = run.get("train_config") or _read(folder / "train_config.json")
    training = run.get("training") or {}
    title = f"# {shown.name}: {FAMILY_NAMES.get(family, family)} draft head for `{target}`"
    out = [title, "", f"Speculative-decoding draft head trained with draftsmith (family `{family}`, "
           f"{'our own format' if facts['format'] == 'draftsmith' else facts['format'] + ' format'}; "
           f"reads {facts['reads']}). It drafts tokens for the frozen target `{target}`, which verifies "
           "them: the output is the target's own (lossless).", "", "## Recipe", ""]
    draft = (tc.get("draft") or {}) if tc else {}
    args = draft or facts["init_args"]
    out.append(f"- draft: `{json.dumps({k: v for k, v in args.items() if v is not None and k != '_target_'})}`")
    for key, label in (("init_from", "continued from"), ("time_budget_s", "time budget (s)")):
        if tc.get(key) is not None:
            out.append(f"- {label}: `{tc[key]}`")
    data = tc.get("data") or {}
    source = run.get("data_source") or data.get("source")
    if source:
        out.append(f"- data: `{source}` ({data.get('features', 'online')} features)")
    temp = answer_temperature(data) if tc else None
    if temp is not None:
        out.append(f"- answers: the target's own, {'greedy (T=0)' if temp == 0 else f'sampled at T={temp:g}'}; "
                   f"the head is for decoding at T={temp:g} (`python -m eval` notes any other temperature)")
    for split, f in (run.get("features") or {}).items():
        out.append(f"- {split} features: {f.get('samples', 0):,} conversations, {f.get('tokens', 0):,} tokens")
    out += ["", "## Training", ""]
    if training:
        out.append(f"- steps: {training.get('global_step', '–')}, tokens: {training.get('train_tokens', 0):,}, "
                   f"time: {_f(training.get('train_time_s'), 0)} s")
        if "train_tokens_including_init" in training:
            out.append(f"- tokens including the runs it continued: {training['train_tokens_including_init']:,}")
        acc = [training[k] for k in sorted((k for k in training if k.startswith("val/acc_") and k[8:].isdigit()),
                                           key=lambda k: int(k[8:]))]
        out.append(f"- validation expected acceptance length (`val/acc_len`): {_f(training.get('val/acc_len'))}; "
                   f"per drafted position: {' / '.join(_f(a) for a in acc) or '–'}")
    else:
        out.append("- no training summary found (the run's result.json)")
    ev = evaluation if evaluation is not None else run.get("evaluation")
    try:
        name = pick_drafter(ev, drafter) if ev else None
    except UserError:
        if evaluation is not None or drafter:  # asked for: the error stands
            raise
        name = None  # the report's own evaluation compares several heads: the card waits for drafter=
        out += ["", "## Decoding, measured", "", "The report's evaluation compares several heads; write this card with "
                "`python -m train.card path=<this folder> drafter=<name>` to show this one's τ and speed-up."]
    if ev and name:
        proto = ev.get("protocol", {})
        out += ["", "## Decoding, measured", "",
                f"`python -m eval` drafter `{name}`: {proto.get('limit', '–')} prompts a set, "
                f"{proto.get('max_new_tokens', '–')} new tokens, k={proto.get('k', '–')}, target in {proto.get('dtype', '–')}."]
        if measured:
            out.append(f"Measured {measured}.")
        out += ["", "| set | T | τ | speed-up | acceptance per position |", "|---|---|---|---|---|"]
        for set_name, per_set in ev.get("results", {}).items():
            for temp, per_t in per_set.items():
                r = per_t.get(name)
                if r:
                    pos = " / ".join(_f(a, 2) for a in r.get("acceptance_per_position", [])[:6])
                    out.append(f"| {SETS.get(set_name, set_name)} | {temp[2:]} | {_f(r.get('tau'), 2)} | {_f(r.get('speedup'), 2)}× | {pos} |")
    out += ["", "## Use", "", "```bash",
            f"python -m eval \"+drafters.head={{_target_: eval.decoding.drafters.load_head, path: {shown}}}\""]
    serve = serving_lines(family, str(shown), facts["format"], serving_target(target), facts.get("num_steps"))
    out += serve + ["```", ""]
    if not serve:
        out.append(f"`{family}` is not servable by vLLM/SGLang: no serving format holds it; it drafts in draftsmith's decoder.")
        out.append("")
    return "\n".join(out)


def write_card(folder: str | Path, src: str | Path | None = None, evaluation: str | Path | dict | None = None,
               drafter: str | None = None, measured: str | None = None, shown_as: str | Path | None = None) -> Path:
    """Write ``folder/README.md`` (atomically) for the draft in ``folder``; ``src``: where its run's facts are
    (a run directory or a shipped folder; default ``folder`` itself); ``shown_as``: the path the card names."""
    folder = Path(folder)
    if isinstance(evaluation, (str, Path)):
        if not Path(evaluation).exists():
            raise UserError(f"evaluation={evaluation}: no such results.json (write one with `python -m eval ...`)")
        evaluation = _read(Path(evaluation))
    text = card_text(folder, folder_facts(folder), run_facts(Path(src) if src else folder), evaluation, drafter, measured,
                     Path(shown_as) if shown_as else None)
    with atomic_file(folder / "README.md") as f:
        f.write(text)
    return folder / "README.md"


@hydra.main(config_path="../conf", config_name="card", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    if not cfg.path:
        raise UserError("path: give an exported or shipped draft folder (path=assets/smollm2-eagle3)")
    print(f"wrote {write_card(cfg.path, cfg.src, cfg.evaluation, cfg.drafter, cfg.measured)}")


if __name__ == "__main__":
    run_main(main)
