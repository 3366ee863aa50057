"""``python -m eval.curve``: learning curves. Each family trains along a list of budgets in ONE resumed run (the
curve costs its longest run), and at every point its exported draft is evaluated through the one decoder on the
same prompts; plain decoding and the baselines (n-gram, ...) are the horizontal references.

    python -m eval.curve                                              # EAGLE-3 at 50, 100, 200 steps on MT-Bench
    python -m eval.curve budgets=[100,300,900] "+families.mtp=['draft=mtp']"
    python -m eval.curve unit=tokens budgets=[2e5,4e5,8e5] tokens_per_step=2500
    python -m eval.curve schedule=fixed budgets=[100,200,400]         # one cosine schedule to the last budget
    python -m eval.curve unit=seconds budgets=[900,1800,3600] "+families.mtp=['experiment=mtp_cpu1h']"   # one CPU hour

Point i runs ``python -m train ... ckpt_path=last trainer.max_steps=<steps_i>`` in ``<run_dir>/<family>``, so it
continues from point i−1's last checkpoint (``schedule=raise``, the default: each resume stretches the schedule to
the new budget; ``schedule=fixed``: ``trainer.max_steps`` is the last budget and ``stop_at_step`` ends each point,
so every point lies on the one schedule of the longest run). ``unit=seconds``: budgets are seconds of training
time (``time_budget_s``, summed over resumes); ``fixed`` runs the schedule of the last budget and ends each point
with ``stop_at_s``, ``raise`` stretches ``time_budget_s`` to each point. A finished point (``points/<steps>.json``) is not
trained or evaluated again unless its settings changed (``<run_dir>/<family>/curve_key.json``: the training
overrides, the schedule and the evaluation settings; a change starts that family's run again), and
``references.json`` is measured again when the evaluation settings or baselines change. Validation expected acceptance length (``val/acc_len``) is that of the exported draft
(the best checkpoint by val acc_len so far). Writes ``curve.json`` (points, references, the Pearson correlation
between val acc_len and decoder τ across all points, and ``correlation_t1``: val acc_len_t1, the T=1 acceptance that
heads trained on the target's distribution report, against τ at T=1) and ``curve.png`` (τ against training tokens, one line per
family and temperature, references dashed) into ``run_dir``.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from data.errors import UserError, cli, guard_out, instantiate, run_main, write_json


UNITS = ("steps", "tokens", "seconds")
NO_STEP_CAP = 10_000_000  # unit=seconds: the time budget ends a run, trainer.max_steps is out of reach


def budget_steps(budgets: list[float], unit: str, tokens_per_step: float | None) -> list[int]:
    """Budgets → increasing training steps (tokens are converted with ``tokens_per_step``), or whole seconds of
    training time for ``unit=seconds``."""
    if unit not in UNITS:
        raise UserError(f"unit={unit!r}: use one of {', '.join(UNITS)}")
    if not budgets:
        raise UserError("budgets=[]: give at least one budget")
    if unit == "tokens":
        if not tokens_per_step or tokens_per_step <= 0:
            raise UserError("unit=tokens needs tokens_per_step (non-padding training tokens per optimiser step; "
                            "train_tokens / global_step of any result.json)")
        steps = [max(1, round(float(b) / tokens_per_step)) for b in budgets]
    else:
        steps = [int(b) for b in budgets]
    if any(s < 1 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise UserError(f"budgets={list(budgets)} ({unit}) → steps {steps}: must be >= 1 and strictly increasing")
    return steps


def last_step(run: Path) -> int:
    """Global step of ``run/checkpoints/last.ckpt`` (0 when the run has not started)."""
    import torch

    p = run / "checkpoints" / "last.ckpt"
    return int(torch.load(p, map_location="cpu", weights_only=False)["global_step"]) if p.exists() else 0


def exported_acc_len(result: dict) -> tuple[float | None, list[float], float | None]:
    """val acc_len, per-step accuracies and val acc_len_t1 (the T=1 acceptance; heads trained on the target's
    distribution only) of the exported (best) checkpoint; the run's last validation if the checkpoint does not
    record them."""
    import torch

    metrics = {}
    best = result.get("best_checkpoint")
    if best and Path(best).exists():
        metrics = torch.load(best, map_location="cpu", weights_only=False).get("val_metrics") or {}
    if "val/acc_len" not in metrics:
        metrics = result
    accs = [float(metrics[f"val/acc_{j}"]) for j in range(64) if f"val/acc_{j}" in metrics]
    v, v1 = metrics.get("val/acc_len"), metrics.get("val/acc_len_t1")
    return (None if v is None else float(v)), accs, (None if v1 is None else float(v1))


def budget_overrides(unit: str, schedule: str, point: int, last_budget: int) -> list[str]:
    """The ``python -m train`` overrides that end a run at budget ``point`` (steps, or seconds of training time)."""
    if schedule not in ("raise", "fixed"):
        raise UserError(f"schedule={schedule!r}: use raise or fixed")
    if unit == "seconds":
        cap = f"trainer.max_steps={NO_STEP_CAP}"
        return [f"time_budget_s={point}", cap] if schedule == "raise" else [f"time_budget_s={last_budget}",
                                                                          f"stop_at_s={point}", cap]
    return [f"trainer.max_steps={point}"] if schedule == "raise" else [f"trainer.max_steps={last_budget}",
                                                                      f"stop_at_step={point}"]


def train_point(family: str, overrides: list[str], shared: list[str], run: Path, steps: int, last_budget: int,
                schedule: str, unit: str = "steps", fresh: bool = False) -> dict:
    """Continue ``family``'s one run to budget ``steps`` (global steps, or seconds of training time); return its
    result.json and the step it resumed from. ``fresh``: start the run again from scratch (its settings changed)."""
    start = 0 if fresh else last_step(run)
    if unit != "seconds" and start > steps:
        raise UserError(f"{run}: already at step {start} > {steps}; use a new run_dir for a shorter curve")
    budget = budget_overrides(unit, schedule, steps, last_budget)
    label = f"{steps} s of training" if unit == "seconds" else f"step {steps}"
    cmd = [sys.executable, "-m", "train", *shared, *overrides, *budget, f"name=curve-{family}", f"hydra.run.dir={run}",
           *(["ckpt_path=null", "overwrite=true"] if fresh else ["ckpt_path=last"])]
    print(f"\n== {family}: step {start} → {label}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise UserError(f"training {family} to {label} failed (exit {rc}); rerun `python -m eval.curve` to resume")
    result = json.loads((run / "result.json").read_text())
    print(f"== {family} at step {result['global_step']} after {time.time() - t:.0f} s", flush=True)
    return {"result": result, "resumed_from_step": start}


def taus(results: dict, drafter: str, key: str = "tau") -> dict[str, dict[str, float]]:
    """{temperature label: {set: τ}} of one drafter in an ``eval.run.evaluate`` result (``key="speedup"``: its
    speed-up over plain decoding measured in the same run)."""
    out: dict[str, dict[str, float]] = {}
    for set_name, by_t in results.items():
        for t_label, row in by_t.items():
            if drafter in row and key in row[drafter]:
                out.setdefault(t_label, {})[set_name] = float(row[drafter][key])
    return out


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation; None with fewer than 3 points or no spread."""
    if len(xs) < 3:
        return None
    mx, my = mean(xs), mean(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def correlations(points: list[dict]) -> dict[str, Any]:
    """Pearson r between val acc_len and mean decoder τ over the sets, across all points, per temperature and
    over every (point, temperature) pair."""
    out: dict[str, Any] = {}
    pairs_all: list[tuple[float, float]] = []
    labels = sorted({t for p in points for t in p["tau_mean"]})
    for t in labels:
        pairs = [(p["val_acc_len"], p["tau_mean"][t]) for p in points if p["val_acc_len"] is not None and t in p["tau_mean"]]
        pairs_all += pairs
        out[t] = {"pearson": pearson(*map(list, zip(*pairs))) if pairs else None, "n": len(pairs)}
    out["all"] = {"pearson": pearson(*map(list, zip(*pairs_all))) if pairs_all else None, "n": len(pairs_all)}
    return out


def correlation_t1(points: list[dict], label: str = "T=1") -> dict[str, Any]:
    """Pearson r between val acc_len_t1 (the T=1 acceptance on validation) and mean decoder τ at ``label``."""
    pairs = [(p["val_acc_len_t1"], p["tau_mean"][label]) for p in points
             if p.get("val_acc_len_t1") is not None and label in p["tau_mean"]]
    return {"pearson": pearson(*map(list, zip(*pairs))) if pairs else None, "n": len(pairs)}


def plot(points: list[dict], references: dict, path: Path, x: str = "train_tokens") -> None:
    """τ against ``x`` (a point's ``train_tokens`` or ``train_time_s``), one line per family and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = sorted({t for p in points for t in p["tau_mean"]})
    styles = ["-o", "-s", "-^", "-d"]
    for fam in dict.fromkeys(p["family"] for p in points):
        ps = sorted((p for p in points if p["family"] == fam), key=lambda p: p[x] or 0)
        for i, t in enumerate(labels):
            xs = [p[x] for p in ps if t in p["tau_mean"]]
            ax.plot(xs, [p["tau_mean"][t] for p in ps if t in p["tau_mean"]], styles[i % len(styles)], label=f"{fam} {t}")
    for j, (name, by_t) in enumerate(references.items()):
        for i, t in enumerate(labels):
            if t in by_t:
                ax.axhline(by_t[t], linestyle="--" if i == 0 else ":", color=f"C{(j + 5) % 10}", linewidth=1,
                           label=f"{name} {t}")
    what = "training time (s)" if x == "train_time_s" else "training tokens"
    ax.set_xlabel(what)
    ax.set_ylabel("τ (tokens per verification, mean over sets)")
    ax.set_title(f"Learning curves: decoder τ against {what}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def eval_key(cfg: DictConfig) -> dict:
    """What a point's or a reference's decoder measurement depends on besides the draft (its cache key)."""
    from omegaconf import OmegaConf

    return {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in ("target", "eval_set", "temperatures", "top_p", "k", "max_new_tokens", "limit", "seed")}


def run_key(cfg: DictConfig, overrides: list[str], steps: list[int]) -> dict:
    """The cache key of a family's run and its points: its training overrides (with the schedule and, for
    ``schedule=fixed``, the last budget that sets it) and the evaluation settings."""
    return {"overrides": [*cfg.train_overrides, *overrides], "unit": cfg.unit, "schedule": cfg.schedule,
            "last_budget": steps[-1] if cfg.schedule == "fixed" else None, "eval": eval_key(cfg)}


def is_curve_dir(path: Path) -> bool:
    """A ``run_dir`` of ours: Hydra's folder, the references and curve, and training runs."""
    return all(p.name in ("hydra", "references.json", "curve.json", "curve.png") or p.name.startswith(".")
               or (p / ".hydra").is_dir() or (p / "points").is_dir() or (p / "curve_key.json").exists()
               for p in path.iterdir())


def run(cfg: DictConfig) -> dict:
    from eval.__main__ import check_eval_config
    from eval.decoding.drafters import build_drafter, load_head
    from eval.run import build_sets, evaluate, protocol_of
    from models.target import load_tokenizer

    check_eval_config(cfg)  # before hours of training
    run_dir = guard_out(cfg.run_dir, "run_dir", is_curve_dir, overwrite=bool(cfg.get("overwrite")),
                        what="a learning curve of ours")
    steps = budget_steps(list(cfg.budgets), cfg.unit, cfg.get("tokens_per_step"))
    families = {k: list(v) for k, v in (cfg.families or {}).items() if v is not None}
    if not families:
        raise UserError("families is empty: name at least one family (e.g. \"families.eagle3=['draft=eagle3']\")")
    target = instantiate(cfg.target, device=cfg.get("device", "auto"))  # auto: a GPU when one is visible
    tok = load_tokenizer(cfg.target.name_or_path)
    sets = build_sets(cfg)
    temps = list(cfg.temperatures)
    args = (temps, cfg.k, cfg.max_new_tokens, cfg.top_p, cfg.seed)
    refs_path = run_dir / "references.json"
    from omegaconf import OmegaConf

    refs_key = {**eval_key(cfg), "baselines": OmegaConf.to_container(cfg.baselines, resolve=True) if cfg.baselines else None}
    refs = json.loads(refs_path.read_text()) if refs_path.exists() else {}
    if refs.get("key") != refs_key:  # plain decoding and the baselines, once per setting, on the same prompts
        base = {name: build_drafter(node, target) for name, node in (cfg.baselines or {}).items() if node is not None}
        res = evaluate(target, tok, base, sets, *args)
        refs = {key: {name: {t: mean(v.values()) for t, v in taus(res, name, key).items()} for name in ["plain", *base]}
                for key in ("tau", "speedup")}
        write_json(refs_path, {**refs, "key": refs_key})
    references = refs["tau"]
    protocol = protocol_of(cfg, tok, {**{n: None for n in references}, **families}, budgets=list(cfg.budgets),
                           unit=cfg.unit, steps=steps, schedule=cfg.schedule, train_overrides=list(cfg.train_overrides))
    points = []
    for fam, overrides in families.items():
        run = run_dir / fam
        key = run_key(cfg, overrides, steps)
        keyfile = run / "curve_key.json"
        have = json.loads(keyfile.read_text()) if keyfile.exists() else None
        fresh = have != key and any(p.exists() for p in (run / "points", run / "checkpoints", run / "result.json"))
        if fresh:  # trained or measured with other settings: its points are stale, the run starts again
            print(f"note: {run} was made with other settings ({'unrecorded' if have is None else have}); "
                  f"starting {fam} again", flush=True)
            shutil.rmtree(run / "points", ignore_errors=True)
        write_json(keyfile, key)
        for s in steps:
            done = run / "points" / (f"{s}s.json" if cfg.unit == "seconds" else f"{s}.json")
            if done.exists():
                points.append(json.loads(done.read_text()))
                continue
            tr = train_point(fam, overrides, list(cfg.train_overrides), run, s, steps[-1], cfg.schedule, cfg.unit,
                             fresh=fresh)
            fresh = False
            result = tr["result"]
            acc_len, accs, acc_len_t1 = exported_acc_len(result)
            res = evaluate(target, tok, {fam: load_head(result["export"], target)}, sets, *args)
            by_t, speed = taus(res, fam), taus(res, fam, "speedup")
            point = {"family": fam, "budget": s if cfg.unit != "tokens" else float(cfg.budgets[steps.index(s)]),
                     "unit": cfg.unit, "steps": int(result["global_step"]), "resumed_from_step": tr["resumed_from_step"],
                     "train_tokens": int(result.get("train_tokens", 0)), "train_time_s": result.get("train_time_s"),
                     "val_acc_len": acc_len, "val_acc": accs, "val_acc_len_t1": acc_len_t1, "tau": by_t,
                     "tau_mean": {t: mean(v.values()) for t, v in by_t.items()}, "speedup": speed,
                     "speedup_mean": {t: mean(v.values()) for t, v in speed.items()},
                     "acceptance_per_position": {f"{sn} {t}": row[fam]["acceptance_per_position"]
                                                 for sn, r in res.items() for t, row in r.items() if fam in row},
                     "greedy": {f"{sn} {t}": {k: row[fam][k] for k in ("greedy_identical", "numerical_ties")}
                                for sn, r in res.items() for t, row in r.items() if row.get(fam, {}).get("greedy_identical")}}
            write_json(done, point)
            points.append(point)
            print(f"== {fam} @ {point['steps']} steps / {point['train_tokens']} tokens: val acc_len "
                  f"{acc_len if acc_len is None else round(acc_len, 3)}, τ {point['tau_mean']}", flush=True)
    corr, corr1 = correlations(points), correlation_t1(points)
    out = {"protocol": protocol, "references": references, "references_speedup": refs.get("speedup", {}),
           "points": points, "correlation": corr, "correlation_t1": corr1}
    write_json(run_dir / "curve.json", out)
    plot(points, references, run_dir / "curve.png", x="train_time_s" if cfg.unit == "seconds" else "train_tokens")
    for t, c in corr.items():
        r = c["pearson"]
        print(f"Pearson(val acc_len, τ) {t}: {'n/a' if r is None else f'{r:.3f}'} over {c['n']} points")
    if corr1["n"]:
        r = corr1["pearson"]
        print(f"Pearson(val acc_len_t1, τ) T=1: {'n/a' if r is None else f'{r:.3f}'} over {corr1['n']} points")
    print(f"wrote {run_dir}/curve.json, curve.png")
    return out


@hydra.main(config_path="../conf", config_name="curve", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    run_main(main)
