"""``python -m eval.compare``: every drafter family trained on the same data, tokens and seed, then evaluated
side by side through the one decoder, beside plain decoding and the baselines (n-gram, a small draft model).

    python -m eval.compare                                     # train (or resume) all families, then evaluate
    python -m eval.compare train=false limit=5                 # evaluate what is already under run_dir
    python -m eval.compare "+families.dflash16=['draft=dflash','draft.block_size=16']" families.mtp=null   # add, remove
    python -m eval.compare "train_overrides=[trainer.max_steps=20]" run_dir=runs/compare-smoke
    python -m eval.compare budget=time time_budget_s=600 run_dir=runs/compare-10min   # equal compute, not equal tokens

Each family trains in its own ``python -m train`` process into ``<run_dir>/<family>`` with ``ckpt_path=last``,
so an interrupted comparison resumes where it stopped; a family whose ``result.json`` exists is not
retrained unless its overrides changed (``<run_dir>/<family>/overrides.json``; a changed family trains again from
scratch). Writes ``compare.json``, ``compare.md`` (the summary table: τ and speed-up per set at each
temperature, trainable parameters, training tokens and time) plus the full per-position report of
``python -m eval`` (``results.json``, ``results.md``, ``acceptance.png``) into ``<run_dir>/eval``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from data.errors import UserError, atomic_file, cli, guard_out, instantiate, run_main, write_json


def train_family(name: str, overrides: list[str], shared: list[str], run_dir: Path) -> dict:
    """Train one family in a child process (resumable); return its ``result.json``. The run is keyed by its
    overrides (``<run_dir>/<name>/overrides.json``): a finished run trained with other overrides is trained
    again from scratch, an interrupted one with the same overrides resumes."""
    out = run_dir / name
    result = out / "result.json"
    key = [*shared, *overrides]
    keyfile = out / "overrides.json"
    have = json.loads(keyfile.read_text()).get("overrides") if keyfile.exists() else None
    if not result.exists() or have != key:
        again = have != key and any(p.exists() for p in (result, out / "checkpoints", out / "draft"))
        if again:
            print(f"note: {out} was trained with {have if have is not None else 'unrecorded overrides'}; training "
                  f"{name} again with {key}", flush=True)
        cmd = [sys.executable, "-m", "train", *shared, *overrides, f"name=compare-{name}", f"hydra.run.dir={out}",
               *(["ckpt_path=null", "overwrite=true"] if again else ["ckpt_path=last"])]
        write_json(keyfile, {"overrides": key})
        print(f"\n== training {name}: {' '.join(cmd[2:])}", flush=True)
        t = time.time()
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            raise UserError(f"training {name} failed (exit {rc}); rerun `python -m eval.compare` to resume it")
        print(f"== {name} trained in {time.time() - t:.0f} s", flush=True)
    return json.loads(result.read_text())


def is_compare_dir(path: Path) -> bool:
    """A ``run_dir`` of ours: Hydra's folder, ``eval/``, and training runs (each with its hydra config)."""
    return all(p.name in ("hydra", "eval") or (p / ".hydra").is_dir() or (p / "overrides.json").exists()
               for p in path.iterdir())


def budget_overrides(budget: str, seconds: float | None) -> list[str]:
    """``budget=steps``: nothing (every family trains ``trainer.max_steps``, equal tokens); ``budget=time``: every
    family trains ``time_budget_s`` seconds of wall time (equal compute), with a step cap far out of reach."""
    if budget == "steps":
        return []
    if budget != "time":
        raise UserError(f"budget={budget!r}: use steps (equal tokens) or time (equal wall time, time_budget_s)")
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise UserError(f"time_budget_s={seconds}: budget=time needs the seconds each family trains, a number > 0")
    return [f"time_budget_s={float(seconds)}", "trainer.max_steps=10000000"]


def summary_table(results: dict, trained: dict, protocol: dict) -> str:
    """One row per drafter: τ and speed-up per (set, temperature), then cost columns."""
    cols = [(s, t) for s, by_t in results.items() for t in by_t]
    head = ["drafter", *[f"τ {s} {t}" for s, t in cols], *[f"speed-up {s} {t}" for s, t in cols],
            "trainable params", "train tokens", "train time"]
    drafters = list(next(iter(next(iter(results.values())).values())))
    lines = [f"Protocol: k={protocol['k']}, max_new_tokens={protocol['max_new_tokens']}, prompts per set ≤ {protocol['limit']}, "
             f"top_p={protocol['top_p']}, target `{protocol['target']}`; τ counts the bonus token; speed-up is "
             "tokens/s over plain decoding of the same prompts in the same run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in drafters:
        tr = trained.get(d, {})
        cells = [d, *[f"{results[s][t][d]['tau']:.2f}" for s, t in cols],
                 *[f"{results[s][t][d].get('speedup', 1.0):.2f}×" for s, t in cols],
                 f"{tr['trainable_params'] / 1e6:.2f}M" if tr else "", f"{tr['train_tokens'] / 1e3:.0f}k" if tr else "",
                 f"{tr['train_time_s'] / 60:.1f} min" if tr else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> dict:
    from eval.decoding.drafters import build_drafter, load_head
    from eval.run import build_sets, evaluate, protocol_of, write_report
    from models.target import load_tokenizer
    from eval.__main__ import check_eval_config

    check_eval_config(cfg)  # before hours of training
    run_dir = guard_out(cfg.run_dir, "run_dir", is_compare_dir, overwrite=bool(cfg.get("overwrite")),
                        what="a comparison of ours")
    families = {k: list(v) for k, v in (cfg.families or {}).items() if v is not None}
    shared = list(cfg.train_overrides) + budget_overrides(cfg.get("budget", "steps"), cfg.get("time_budget_s"))
    trained: dict = {}
    for name, overrides in families.items():
        if cfg.train:
            trained[name] = train_family(name, overrides, shared, run_dir)
        else:
            p, k = run_dir / name / "result.json", run_dir / name / "overrides.json"
            if not p.exists():
                raise UserError(f"{p}: family {name} is not trained; run with train=true or remove it from families")
            if k.exists() and json.loads(k.read_text()).get("overrides") != [*shared, *overrides]:
                raise UserError(f"{k}: family {name} was trained with other overrides than these; run with train=true "
                                "to train it again")
            trained[name] = json.loads(p.read_text())

    target = instantiate(cfg.target, device=cfg.get("device", "auto"))  # auto: a GPU when one is visible
    tok = load_tokenizer(cfg.target.name_or_path)
    drafters = {name: build_drafter(node, target) for name, node in (cfg.baselines or {}).items() if node is not None}
    for name, tr in trained.items():
        drafters[name] = load_head(tr["export"], target)
    sets = build_sets(cfg)
    protocol = protocol_of(cfg, tok, drafters, train_overrides=shared, families=families)
    t = time.time()
    results = evaluate(target, tok, drafters, sets, list(cfg.temperatures), cfg.k, cfg.max_new_tokens, cfg.top_p, cfg.seed)
    out = run_dir / "eval"
    write_report(results, protocol, out)
    table = summary_table(results, trained, protocol)
    with atomic_file(out / "compare.md") as f:
        f.write(table)
    write_json(out / "compare.json", {"protocol": protocol, "trained": trained, "results": results,
                                      "eval_time_s": round(time.time() - t, 1)})
    print(table)
    print(f"wrote {out}/compare.md, compare.json, results.md, acceptance.png")
    return results


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    run_main(main)
