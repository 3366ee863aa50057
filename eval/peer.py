"""``python -m eval.peer``: draftsmith's trainer beside vLLM's ``speculators`` trainer (0.9.0), on the same tokens,
judged by one decoder, for a family both train (``conf/peer_family``: EAGLE-3, DSpark, DFlash).

    python -m eval.peer                                   # conf/peer.yaml: EAGLE-3, the eagle3_quick recipe, 200 steps each
    python -m eval.peer peer_family=dspark                # DSpark, the dspark_quick recipe
    python -m eval.peer peer_family=dflash                # DFlash from the anchor slot, the dflash_quick recipe
    python -m eval.peer steps=300 limit=10 precision=32

A family file names speculators' ``--speculator-type``, draftsmith's recipe, the settings both sides train with
(``matched``: draftsmith's key → speculators' flag and the one value) and each side's own extra settings. ``out``
(``runs/peer/<family>``) keeps every stage's output and the settings that made them; a rerun with other settings
there is refused (give another ``name=``).

Stages (each skipped when its output is already there, so a run can be continued):

1. **features**: draftsmith's offline feature cache of the recipe (``python -m data.features``, bf16 states), or
   ``feature_dir=`` an existing one written for the same target and taps.
2. **convert** (:func:`convert_cache`): that cache in speculators' layout, ``<out>/speculators-data``: a ``datasets``
   table (``input_ids``, ``loss_mask``, ``seq_len``; train rows, then the held-out rows its ``train_data_ratio``
   splits off), ``hidden_states/hs_<row>.safetensors`` with ``hidden_states`` [n, taps+1, d] (the cache's tap states
   in tap order, then the target's last decoder layer output *before* the final norm) and ``token_ids`` [n], and the
   draft vocabulary as ``d2t-<V>.npy``/``t2d-<V>.npy``. The cache holds the final-normed last state only; the
   pre-norm state is recomputed here by running the target over the cached tokens with a hook on its final norm's
   input, on right-padded batches of 8 (checked: the hook's state through the final norm equals the cached state
   within the cache's rounding: ``prenorm_check_max_abs``). The draft
   vocabulary is the one draftsmith builds from the same loss-masked training tokens
   (:func:`models.heads.vocab.build_draft_vocab`), so both heads draft over the same 2,048 tokens.
3. **speculators**: ``speculators train`` through ``eval/peer_side.py`` in the side venv
   (:func:`eval.check_export.side_python`) with the recipe's settings: taps, the draft vocabulary, the family's matched
   values (EAGLE-3: one decoder layer, ``ttt_steps`` and decay), AdamW lr 1e-3 betas (0.9, 0.999) weight decay 0, 4% warm-up then cosine to 0, the frozen
   lm_head on the target's rows (speculators always freezes it), ``steps`` steps, packed batches of
   ``batch_size × max_length`` tokens, its eager loss and sdpa attention (Triton and flex attention need a GPU
   compiler; on a GPU its defaults, the fused loss and flex attention, stay), bf16 autocast or fp32 as ``precision``. Its other
   defaults stay (EAGLE-3: ``norm_before_fc``, ``norm_before_residual``, ``norm_output``, a sliding-window layer of
   2,048), all imported faithfully by :func:`models.formats.load_draft`.
4. **draftsmith**: ``python -m train`` with the recipe and the matching overrides (``features=offline`` on the same
   cache, the family's own (EAGLE-3: ``draft.freeze_lm_head=true``), betas (0.9, 0.999), ``trainer.max_steps=steps``, the same precision).
5. **eval**: ``python -m eval`` with both heads as drafters on the held-out sets at T=0 and T=1 (``limit`` prompts
   each, ``k`` drafted tokens).

Writes ``<out>/peer.json`` and ``<out>/peer.md``: τ per set and temperature, per-position acceptance, training tokens
per second and peak memory of each trainer (tokens: the real tokens of the batches it trained on; memory: a GPU's
``max_memory_allocated``, on a CPU the trainer process's peak resident set — which includes the Python runtime and
libraries, so compare it between the two trainers only as a rough figure).

**What is not matched** for EAGLE-3 (where it lives, and what a switch would measure):

- *Loss mask alignment*: draftsmith scores TTT step j at position t (which predicts token t+2+j) where
  ``loss_mask[t+2+j]`` (:func:`models.heads.eagle3.step_weights`); speculators where ``loss_mask[t+1+j]``: its
  ``shift_batch`` (``speculators/models/eagle3/data.py``) drops ``loss_mask[0]`` and ``compute_metrics``
  (``speculators/models/eagle3/metrics.py``) shifts it by j for step j, one position less than the token predicted.
  The first token of every assistant turn is scored by draftsmith and not by speculators; the first token after a
  turn (the next user turn's template) by speculators and not by draftsmith. To measure: a
  ``step_weights`` offset of 1+j instead of 2+j, trained on this command's cache, compared on τ.
- *Targets outside the draft vocabulary*: draftsmith drops positions whose target argmax is not in the draft
  vocabulary (``in_vocab`` in :meth:`models.heads.eagle3.Eagle3Head.training_loss`); speculators keeps them, with the
  target distribution renormalised over the draft vocabulary (``compute_metrics``). At 2,048 of 8,192 tokens it is
  the share of positions :func:`convert_cache` reports as ``argmax_outside_draft_vocab``. To measure: ``in_vocab`` set to all ones.
- *Packed vs padded batches*: speculators packs conversations into one row of ``total_seq_len`` tokens with
  document masks (``MultipackDistributedBatchSamplerV2``, ``speculators/train/data.py``'s ``CollateFn``; a
  conversation that does not fit is cut); draftsmith pads ``batch_size`` conversations of up to ``max_length``
  (:func:`data.features.collate`). Same tokens per step on average, not the same batches. The report gives each
  side's share of computed positions that were real tokens (``batch_fill``): the most packing could add to
  draftsmith's tokens per second is the inverse of its share.
- *Draft final norm*: draftsmith starts it from the target's final norm (:func:`models.layers.copy_final_norm`),
  speculators from ones.
- *Positions*: speculators' position ids start at 1 (``shift_batch``), draftsmith's at 0; RoPE is relative, so this
  changes no score.
- *Variants*: speculators' defaults above; draftsmith's recipe (eagle3_quick) takes only ``norm_before_residual``, which
  alone gave the gain of all three at 200 steps (docs/results.md, "EAGLE-3's residual norm").

For DSpark the loss (0.1 CE + 0.9 TV + the confidence term), block, layers, Markov rank and slot weights are matched;
not matched: speculators samples up to ``--max-anchors`` anchors per packed row, draftsmith up to ``num_anchors`` per
conversation (the same count per step on average), and the packing as above.

For DFlash (the anchor-slot layout of draftsmith's recipe) the block, layers, slot weights, the anchor slot and the
labels (both score against the target's distribution: draftsmith's ``draft.soft``, speculators' ``_backbone_forward``)
are matched; anchors and packing as for DSpark. Against the data's next token the target's distribution drafted 2–8%
further at both temperatures (docs/results.md, "DFlash's labels").
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, atomic_dir, cli, run_main, write_json
from eval.check_export import side_python

ROOT = Path(__file__).resolve().parent.parent
SIDE_SCRIPT = Path(__file__).resolve().parent / "peer_side.py"


# -- the feature cache in speculators' layout ------------------------------------------------------------
@torch.no_grad()
def prenorm_last(target: Any, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's last decoder layer output before its final norm for token ids [T] → [T, d], or a right-padded
    batch [B, T] (``attention_mask``) → [B, T, d]: a hook on the final norm's input."""
    norm = target.model.model.norm
    got = {}
    hook = norm.register_forward_pre_hook(lambda m, args: got.__setitem__("x", args[0].detach()))
    try:
        target(ids if ids.dim() == 2 else ids[None], attention_mask=attention_mask)
    finally:
        hook.remove()
    return got["x"] if ids.dim() == 2 else got["x"][0]


def convert_cache(feature_dir: Path, target: Any, draft_vocab_size: int, out: Path) -> dict:
    """``feature_dir`` (``train``/``heldout`` splits of a draftsmith feature cache) → speculators' data layout in
    ``out`` (atomically; see the module docstring). Returns the counts and checks of the conversion."""
    from safetensors.torch import save_file

    from data.features import FeatureDataset
    from models.heads.vocab import build_draft_vocab

    splits = {s: FeatureDataset(feature_dir / s) for s in ("train", "heldout")}
    V = int(target.config.vocab_size)
    counts = torch.zeros(V)
    for r in splits["train"]:
        ids, mask = r["input_ids"].long(), r["loss_mask"].bool()
        counts += torch.bincount(ids[mask], minlength=V).float()
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    worst, outside, scored = 0.0, 0, 0
    head = target.lm_head().weight
    with atomic_dir(out) as tmp:
        tmp = tmp.resolve()  # the side process runs elsewhere
        hs = tmp / "hidden_states"
        hs.mkdir()
        ids_all, mask_all, offsets, n = [], [], [0], 0
        for split in ("train", "heldout"):
            ds = splits[split]
            for r, pre in _with_prenorm(target, ds):
                ids = r["input_ids"].long()
                normed = target.model.model.norm(pre.float())  # the check, before the cast to the cache's dtype
                pre = pre.to(r["tap_states"].dtype)  # [T, d]
                worst = max(worst, (normed - r["last_state"].float()).abs().max().item())
                if split == "train" and n % 8 == 0:  # the share outside the vocabulary, on every 8th row
                    top = (r["last_state"].float() @ head.T.float()).argmax(-1)  # [T]
                    m = r["loss_mask"].bool()
                    outside += int((~t2d[top[m]]).sum())
                    scored += int(m.sum())
                states = torch.cat([r["tap_states"], pre[:, None]], 1).contiguous()  # [T, taps+1, d]
                save_file({"hidden_states": states, "token_ids": ids}, str(hs / f"hs_{n}.safetensors"))
                ids_all.append(ids)
                mask_all.append(r["loss_mask"].long())
                offsets.append(offsets[-1] + ids.numel())
                n += 1
        save_file({"input_ids": torch.cat(ids_all), "loss_mask": torch.cat(mask_all),
                   "offsets": torch.tensor(offsets)}, str(tmp / "rows.safetensors"))
        import numpy as np

        np.save(tmp / f"d2t-{draft_vocab_size}.npy", d2t.numpy())
        np.save(tmp / f"t2d-{draft_vocab_size}.npy", t2d.numpy())
        run_side({"kind": "table", "rows": str(tmp / "rows.safetensors"), "out": str(tmp / "table")}, tmp)
        for p in (tmp / "table").iterdir():  # the table at the data root, as speculators' loader reads it
            p.rename(tmp / p.name)
        (tmp / "table").rmdir()
        info = {"rows": n, "train_rows": len(splits["train"]), "heldout_rows": len(splits["heldout"]),
                "tokens": offsets[-1], "draft_vocab_size": draft_vocab_size,
                "prenorm_check_max_abs": worst, "argmax_outside_draft_vocab": outside / max(scored, 1)}
        (tmp / "peer_convert.json").write_text(json.dumps(info, indent=2))
    return info


def _with_prenorm(target: Any, ds, batch: int = 8):
    """(row, its pre-norm last state [T, d]) for every row of ``ds``, the target run on right-padded batches."""
    from data.features import collate

    for s in range(0, len(ds), batch):
        rows = [ds[i] for i in range(s, min(s + batch, len(ds)))]
        b = collate([{"input_ids": r["input_ids"].long(), "loss_mask": r["loss_mask"].long()} for r in rows])
        pre = prenorm_last(target, b["input_ids"], b["attention_mask"])  # [B, T, d]
        for i, r in enumerate(rows):
            yield r, pre[i, : r["input_ids"].numel()]


def run_side(job: dict, work: Path, timeout: int = 7200) -> None:
    """Run ``eval/peer_side.py`` on ``job`` in the side venv (output streamed)."""
    py = side_python()
    path = work.resolve() / f"peer-{job['kind']}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([str(py), str(SIDE_SCRIPT), str(path)], cwd=work, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"speculators side run ({job['kind']}) failed with status {r.returncode}")


# -- the stages ------------------------------------------------------------------------------------------
PY = sys.executable


def measured(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run ``cmd`` (output to ``log``) in a wrapper that reports its peak resident set → {seconds, peak_rss_bytes}."""
    wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[2:], stdout=open(sys.argv[1], 'w'), "
            "stderr=subprocess.STDOUT); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
            "sys.exit(r.returncode)")
    t0 = time.time()
    r = subprocess.run([PY, "-c", wrap, str(log), *cmd], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        tail = log.read_text()[-3000:] if log.exists() else r.stderr[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (status {r.returncode}); {log}:\n{tail}")
    return {"seconds": round(time.time() - t0, 1), "peak_rss_bytes": int(r.stdout.strip().splitlines()[-1])}


def recipe(cfg: DictConfig) -> list[str]:
    """The training recipe's overrides shared by the feature writer and draftsmith's trainer: the family's recipe, the
    shared settings, and the family's matched values (``peer_family.matched``: draftsmith key → [flag, value])."""
    fam = cfg.peer_family
    return [f"experiment={fam.experiment}", f"target={cfg.target}", f"data.max_conversations={cfg.max_conversations}",
            f"data.max_length={cfg.max_length}", f"data.batch_size={cfg.batch_size}",
            f"target.tap_layers=[{','.join(str(t) for t in cfg.tap_layers)}]", f"draft.draft_vocab_size={cfg.draft_vocab_size}",
            *[f"{key}={value}" for key, (_, value) in fam.matched.items()]]


def packed_row(cfg: DictConfig) -> int:
    """Tokens of speculators' one packed row a step (``--total-seq-len``): draftsmith's batch of ``batch_size`` ×
    ``max_length``."""
    return int(cfg.batch_size) * int(cfg.max_length)


def flag_args(flag: str, value: Any) -> list[str]:
    """A matched value under speculators' flag: ``[flag, value]``, or for a switch (a bool) ``--x`` / ``--no-x``."""
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    return [flag, str(value)]


def speculators_argv(cfg: DictConfig, data: Path, save: Path, verifier: str, rows: int, train_rows: int) -> list[str]:
    """``speculators train`` arguments matching the recipe (see the module docstring): the shared settings, the
    family's matched values under speculators' flags, and its speculators-only flags."""
    from models.formats.layer_ids import engine_layer_ids

    V, fam = int(cfg.draft_vocab_size), cfg.peer_family
    return ["--speculator-type", str(fam.speculator_type), "--verifier-name-or-path", verifier, "--data-path", str(data),
            "--target-layer-ids", *[str(i) for i in engine_layer_ids(list(cfg.tap_layers), "speculators")],
            "--draft-vocab-size", str(V), "--d2t-path", str(data / f"d2t-{V}.npy"), "--t2d-path", str(data / f"t2d-{V}.npy"),
            *[x for flag, value in fam.matched.values() for x in flag_args(str(flag), value)], *[str(x) for x in fam.speculators],
            "--lr", str(cfg.lr), "--weight-decay", "0", "--optimizer", "adamw", "--scheduler-type", "cosine",
            "--scheduler-warmup-ratio", str(cfg.warmup_ratio), "--max-steps", str(cfg.steps), "--epochs", str(cfg.steps),
            "--total-seq-len", str(packed_row(cfg)),
            "--train-data-ratio", str((train_rows + 0.5) / rows), "--hidden-states-dtype",
            "bfloat16" if str(cfg.precision) == "bf16-mixed" else "float32", "--num-workers", "0", "--on-missing", "raise",
            "--save-path", str(save), "--log-dir", str(save / "logs"), "--no-resume-from-checkpoint", "--seed", str(cfg.seed),
            # its Triton losses and flex attention need a GPU compiler: eager loss and sdpa elsewhere (same results)
            *([] if torch.cuda.is_available() else ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa"])]


def stage_features(cfg: DictConfig, out: Path) -> Path:
    if cfg.feature_dir:
        d = Path(cfg.feature_dir)
        if not (d / "train").is_dir() or not (d / "heldout").is_dir():
            raise UserError(f"feature_dir={d}: no train/ and heldout/ feature cache there; write one with "
                            "`python -m data.features` or leave feature_dir null")
        return d
    d = out / "features"
    if not (d / "heldout" / "manifest-r0.json").exists():
        print(f"[peer] features -> {d}", flush=True)
        measured([PY, "-m", "data.features", *recipe(cfg), "features=offline", f"data.feature_dir={d}", "name=peer"],
                 out / "features.log")
    return d


def stage_speculators(cfg: DictConfig, out: Path, data: Path, info: dict) -> dict:
    from models.target import resolve_path

    save = out / "speculators"
    done = save / "peer_train.json"
    if not done.exists():
        print(f"[peer] speculators train ({cfg.steps} steps) -> {save}", flush=True)
        shutil.rmtree(save, ignore_errors=True)
        save.mkdir(parents=True)
        argv = speculators_argv(cfg, data, save, str(Path(resolve_path(str(cfg.target_name))).resolve()),
                                info["rows"], info["train_rows"])
        (save / "job.json").write_text(json.dumps({"kind": "train", "save_path": str(save), "argv": argv}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
        rss = measured([str(side_python()), str(SIDE_SCRIPT), str(save / "job.json")], out / "speculators.log", env)
        stats = json.loads(done.read_text())
        done.write_text(json.dumps({**stats, "wrapper": rss}, indent=2))
    s = json.loads(done.read_text())
    return {"draft": s["checkpoint"], "steps": s["steps"], "train_tokens": s["tokens"], "train_seconds": round(s["train_seconds"], 1),
            "batch_fill": round(s["tokens"] / (s["steps"] * packed_row(cfg)), 4),
            "tokens_per_s": round(s["tokens"] / max(s["train_seconds"], 1e-9), 1), "peak_memory_bytes": s["peak_memory_bytes"],
            "memory_kind": s["memory_kind"], "device": s["device"]}


def stage_draftsmith(cfg: DictConfig, out: Path, features: Path) -> dict:
    run = out / "draftsmith"
    done = run / "peer_train.json"
    if not done.exists():
        print(f"[peer] draftsmith train ({cfg.steps} steps) -> {run}", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        cmd = [PY, "-m", "train", *recipe(cfg), "features=offline", f"data.feature_dir={features}",
               f"trainer.max_steps={cfg.steps}", f"trainer.precision={cfg.precision}", *cfg.peer_family.draftsmith,
               f"optim.lr={cfg.lr}", "optim.betas=[0.9,0.999]", "optim.weight_decay=0.0", f"optim.warmup_ratio={cfg.warmup_ratio}",
               "optim.min_lr_ratio=0.0", "export_best=false", f"seed={cfg.seed}", "name=peer-draftsmith", f"hydra.run.dir={run}"]
        rss = measured(cmd, out / "draftsmith.log")
        (run / "peer_train.json").write_text(json.dumps({**json.loads((run / "result.json").read_text()), "wrapper": rss}))
    r = json.loads(done.read_text())
    share = round(r["train_tokens"] / r["train_positions"], 4) if r.get("train_positions") else None  # older runs lack it
    return {"draft": str(run / "draft"), "steps": r["global_step"], "train_tokens": r["train_tokens"],
            "train_seconds": r["train_time_s"], "batch_fill": share,
            "tokens_per_s": round(r["train_tokens"] / max(r["train_time_s"], 1e-9), 1),
            "peak_memory_bytes": r["wrapper"]["peak_rss_bytes"], "memory_kind": "cpu peak resident set",
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def stage_eval(cfg: DictConfig, out: Path, heads: dict[str, dict]) -> dict:
    ev = out / "eval"
    if not (ev / "results.json").exists():
        print(f"[peer] eval ({cfg.limit} prompts per set, T={list(cfg.temperatures)}) -> {ev}", flush=True)
        cmd = [PY, "-m", "eval", f"target={cfg.target}", "drafters.ngram=null", "drafters.draft_model=null", "drafters.eagle3=null",
               f"limit={cfg.limit}", f"k={cfg.k}", f"max_new_tokens={cfg.max_new_tokens}",
               f"temperatures=[{','.join(str(t) for t in cfg.temperatures)}]", f"hydra.run.dir={ev}"]
        for name, h in heads.items():
            cmd += [f"+drafters.{name}._target_=eval.decoding.drafters.load_head", f"+drafters.{name}.path={h['draft']}"]
        measured(cmd, out / "eval.log")
    return json.loads((ev / "results.json").read_text())


def table(report: dict) -> str:
    """The markdown table of a report: τ per set and temperature, per-position acceptance, training throughput."""
    heads = list(report["trainers"])
    res = report["eval"]["results"]
    lines = ["| set | T | drafter | τ | acceptance per position |", "|---|---|---|---|---|"]
    for sname, by_t in res.items():
        for tname, by_d in by_t.items():
            for d in heads:
                r = by_d.get(d)
                if r:
                    acc = ", ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"])
                    lines.append(f"| {sname} | {tname} | {d} | {r['tau']:.2f} | {acc} |")
    lines += ["", "| trainer | steps | training tokens | real share of positions | seconds | tokens/s | peak memory (MiB) | memory |",
              "|---|---|---|---|---|---|---|---|"]
    for d, t in report["trainers"].items():
        share = f"{t['batch_fill']:.1%}" if t.get("batch_fill") else "–"
        lines.append(f"| {d} | {t['steps']} | {t['train_tokens']:,} | {share} | {t['train_seconds']} | {t['tokens_per_s']:,} | "
                     f"{t['peak_memory_bytes'] / 2**20:,.0f} | {t['memory_kind']} |")
    c = report["convert"]
    lines += ["", f"Same tokens: {c['train_rows']} training conversations ({c['rows']} rows with the held-out ones, "
              f"{c['tokens']:,} tokens); draft vocabulary {c['draft_vocab_size']} (target argmax outside it at "
              f"{c['argmax_outside_draft_vocab']:.1%} of scored positions of every 8th training row). Measured {report['date']} on "
              f"{report['machine']}: `{report['command']}`."]
    return "\n".join(lines) + "\n"


def page(report: dict, load: str) -> dict:
    """The report as a measurement of the results page (``docs/results/*.json``, rendered by ``python -m eval.results``):
    τ of each side per set and temperature and their ratio, the trainers' throughput and memory in the note."""
    from eval.results import SETS

    cfg, res, c = report["config"], report["eval"]["results"], report["convert"]
    rows = []
    for sname, by_t in res.items():
        for tname, by_d in by_t.items():
            ours, theirs = by_d["draftsmith"]["tau"], by_d["speculators"]["tau"]
            rows.append([SETS.get(sname, sname), tname.removeprefix("T="), f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}×"])
    d, s = report["trainers"]["draftsmith"], report["trainers"]["speculators"]
    note = (f"Training, {d['steps']} steps each on the same {c['train_rows']} conversations (draftsmith's padded batches "
            f"held {d['train_tokens']:,} real tokens, speculators' packed rows {s['train_tokens']:,}): draftsmith "
            f"{d['tokens_per_s']:,.0f} tokens/s, speculators {s['tokens_per_s']:,.0f} tokens/s "
            f"({d['tokens_per_s'] / s['tokens_per_s']:.2f}×){fill(d, s)}; peak memory {d['peak_memory_bytes'] / 2**20:,.0f} against "
            f"{s['peak_memory_bytes'] / 2**20:,.0f} MiB ({d['memory_kind']}). Draft vocabulary of {c['draft_vocab_size']:,} "
            f"tokens (the target's argmax outside it at {c['argmax_outside_draft_vocab']:.1%} of scored positions). "
            f"{cfg['limit']} prompts a set, k={cfg['k']}, {cfg['max_new_tokens']} new tokens.")
    return {"title": f"{cfg['peer_family']['label']}: draftsmith's trainer against speculators' on the same tokens "
            f"({cfg['target']} target)", "date": report["date"], "machine": report["machine"], "load": load,
            "command": report["command"], "source": str(Path(cfg["out"]) / "peer.json"),
            "table": {"header": ["set", "T", "τ draftsmith", "τ speculators", "ratio"], "rows": rows}, "note": note}


def fill(d: dict, s: dict) -> str:
    """What packing is worth, in words: the share of computed positions that were real tokens on each side."""
    if not d.get("batch_fill") or not s.get("batch_fill"):
        return ""
    return (f"; real tokens were {d['batch_fill']:.1%} of the positions of draftsmith's padded batches and "
            f"{s['batch_fill']:.1%} of speculators' packed rows")


EVAL_ONLY = {"limit", "temperatures", "k", "max_new_tokens"}
STAGE_OUTPUTS = ("features", "speculators-data", "speculators", "draftsmith", "eval")


def check_settings(cfg: DictConfig, out: Path) -> None:
    """Stages are reused from ``out``: refuse settings other than those that made them (``peer_settings.json``). Until
    a stage has written something there (a run that failed before its first stage), new settings replace the old."""
    now = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in ("name", "out", "load")}
    path = out / "peer_settings.json"
    if not path.exists() or not any((out / s).exists() for s in STAGE_OUTPUTS):
        write_json(path, now)
        return
    before = json.loads(path.read_text())
    diff = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
    if diff:
        redo = out / "eval" if set(diff) <= EVAL_ONLY else out
        raise UserError(f"out={out}: its stages were made with other {', '.join(diff)}; remove {redo} to redo them "
                        "with these, or give another name=")


@hydra.main(config_path="../conf", config_name="peer", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from models.target import FrozenTarget

    if int(cfg.steps) < 1:
        raise UserError(f"steps={cfg.steps}: training steps for each trainer, >= 1")
    if str(cfg.precision) not in ("32", "bf16-mixed"):
        raise UserError(f"precision={cfg.precision}: 32 (fp32 on both sides) or bf16-mixed (bf16 autocast on both)")
    out = Path(cfg.out).resolve()  # side processes run in other directories
    out.mkdir(parents=True, exist_ok=True)
    check_settings(cfg, out)
    features = stage_features(cfg, out).resolve()
    data = out / "speculators-data"
    if not (data / "peer_convert.json").exists():
        print(f"[peer] convert {features} -> {data}", flush=True)
        target = FrozenTarget(str(cfg.target_name), tap_layers=list(cfg.tap_layers), dtype="float32")
        convert_cache(features, target, int(cfg.draft_vocab_size), data)
    info = json.loads((data / "peer_convert.json").read_text())
    trainers = {"speculators": stage_speculators(cfg, out, data, info), "draftsmith": stage_draftsmith(cfg, out, features)}
    results = stage_eval(cfg, out, trainers)
    from eval.bench_decode import cpu_name

    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": f"{cpu_name()}, {os.cpu_count()} cores"
              + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"),
              "command": "python -m eval.peer " + " ".join(sys.argv[1:]), "config": OmegaConf.to_container(cfg, resolve=True),
              "convert": info, "trainers": trainers, "eval": results}
    write_json(out / "peer.json", report)
    write_json(out / "peer-page.json", page(report, str(cfg.load)))
    md = table(report)
    (out / "peer.md").write_text(md)
    print(md)
    print(f"wrote {out / 'peer.json'}, {out / 'peer.md'}, {out / 'peer-page.json'} (a measurement for docs/results/)")


if __name__ == "__main__":
    run_main(main)
