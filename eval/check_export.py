"""``python -m eval.check_export``: do the speculators library and our import read our exports as we wrote them?

    python -m eval.check_export drafts=[runs/eagle3-embedded,runs/dflash/draft]
    make check-speculators DRAFTS="runs/eagle3-embedded runs/dflash"

For every draft (a run directory or a draft directory, ours or any serving format we import): rebuild it on
its own target (``verifier=``, or the target it records), export it to the speculators format (vLLM's; float32),
and on one real text — a held-out ShareGPT conversation (the training split's id hash), or ``text=`` —
tokenised by the target's tokenizer and run through the target for its real features:

- **speculators**: ``eval/speculators_side.py`` in the side venv ``.venv-speculators`` (torch + speculators
  0.9.0, none of our code; built on first use) loads the export with speculators' own ``from_pretrained``
  and runs its forward on the same inputs; its logits are compared with our head's (max |difference|,
  max |logit|, top-1 agreement), and what it read from the config (class, layer ids, block size, ...) with
  what the head implies;
- **round trip**: the export imported back (:func:`models.formats.load_draft`) must give the same head class,
  taps, weights (bit-identical) and logits, and export again to the same tensors.

A draft the format cannot hold (the DeepSeek-V3-layout MTP of ``draft=mtp``; a DFlash head without q/k norms)
gets one ``error:`` line and the others are still checked. ``<out>/result.json`` holds one record per draft.
Exit status: 0 every draft passed; 1 a check failed (logits beyond ``atol``, a config field read differently,
round trip not identical); 2 a draft was refused (and nothing failed).

The same functions build the cases of ``tests/test_formats.py`` (tiny random targets), so the test and this
command are one implementation. What differs between families (inputs, logits compared, config fields read) is one
row per family in :data:`models.formats.speculators.FAMILIES`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, cli, run_main, write_json
from models.formats.layer_ids import engine_layer_ids
from models.formats.speculators import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
SIDE = ROOT / ".venv-speculators"
SIDE_PINS = ["torch==2.13.0", "speculators==0.9.0"]
SIDE_SCRIPT = Path(__file__).resolve().parent / "speculators_side.py"


def local_verifier(identity: dict) -> str | None:
    """The local folder of a draft's recorded target (``embedded``, ``smollm2``, a GGUF or a folder), else None.

    An export for ``smollm2`` names the hub id ``HuggingFaceTB/SmolLM2-135M-Instruct`` for serving engines; the
    check runs offline, so it exports for the converted local folder instead (same weights)."""
    from models.target import resolve_path

    name = identity.get("name_or_path")
    if not name:
        return None
    try:
        path = resolve_path(str(name))
    except UserError:
        return None
    return path if Path(path).is_dir() else None


# -- the side venv ------------------------------------------------------------------------------------
def side_python() -> Path:
    """The side venv's python, built if missing (pip; torchvision/torchaudio removed: PyPI's break beside the CPU torch).

    A UserError when it is missing and PyPI cannot be reached (the tests skip then)."""
    py, stamp = SIDE / "bin" / "python", SIDE / ".installed"
    if py.exists() and stamp.exists() and stamp.read_text().split() == SIDE_PINS:
        return py
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/speculators/", timeout=15).close()
    except OSError as e:
        raise UserError(f"PyPI unreachable ({e}); cannot build {SIDE.name} with {' '.join(SIDE_PINS)}") from None
    t0 = time.time()
    steps = [] if py.exists() else [[sys.executable, "-m", "venv", str(SIDE)]]
    steps += [[str(py), "-m", "pip", "install", "-q", *SIDE_PINS],
              [str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    stamp.write_text(" ".join(SIDE_PINS) + "\n")
    print(f"built {SIDE.name} in {time.time() - t0:.0f}s", flush=True)
    return py


def run_side(cases: list[dict], work: Path, timeout: int = 1800) -> dict[str, tuple[dict, dict]]:
    """Run speculators on every case (one side process) → {name: (its outputs, what it read from the config)}."""
    from safetensors.torch import load_file

    py = side_python()
    (work / "job.json").write_text(json.dumps({"cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    r = subprocess.run([str(py), str(SIDE_SCRIPT), str(work / "job.json")], cwd=work, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"speculators side run failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return {c["name"]: (load_file(c["out"]), json.loads(Path(c["out"] + ".json").read_text())) for c in cases}


# -- inputs, our logits, what speculators should read -----------------------------------------------------
def default_anchors(T: int, block_size: int, n: int = 16) -> torch.Tensor:
    """``n`` block anchors spread evenly over a sequence of ``T`` tokens (every block inside it)."""
    last = T - block_size
    if last < 0:
        raise UserError(f"{T} tokens cannot hold a block of {block_size}; use a longer text")
    return torch.linspace(0, last, min(n, last + 1)).round().long().unique()


def make_batch(ids: torch.Tensor) -> dict:
    """A training batch of one sequence, every position counted (logits are compared everywhere)."""
    ids = ids.reshape(1, -1)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}


def our_logits(head, target, b: dict, anchors: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Our logits on the inputs speculators' forward gets (EAGLE-3: every training-time-test step [K, 1, T, Vd];
    DFlash/DSpark: block logits at ``anchors``; MTP: every depth's [K, 1, T-K-1, V])."""
    return FAMILIES[head.family].logits(head, target, b, anchors)


@torch.no_grad()
def side_inputs(head, target, ids: torch.Tensor, anchors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """What speculators' forward is given: the target's features of ``ids`` in its conventions."""
    feats = target(ids)
    x = {"hidden_states": feats.tap_states.flatten(-2), "input_ids": ids, "last_hidden_states": feats.last_state}
    return x | FAMILIES[head.family].inputs(head, ids, anchors)


def expected_meta(head, target) -> dict:
    """What speculators must read from the export's config: class, layer ids, depth / block / vocabulary fields."""
    row = FAMILIES[head.family]
    return {"class": row.model_class} | row.meta(head, target)


def make_case(name: str, head, target, export_dir: Path, fmt: str, ids: torch.Tensor, anchors: torch.Tensor | None,
              work: Path, verifier: str) -> tuple[dict, dict, dict]:
    """One side-run case for ``export_dir`` (format ``fmt``) → (case, our logits, the meta speculators must read)."""
    from safetensors.torch import save_file

    x = side_inputs(head, target, ids, anchors)
    save_file({k: v.contiguous() for k, v in x.items()}, str(work / f"{name}.in.safetensors"))
    case = {"name": name, "kind": head.family, "dir": str(export_dir), "inputs": str(work / f"{name}.in.safetensors"),
            "out": str(work / f"{name}.out.safetensors"), "verifier": str(verifier)}
    if fmt != "speculators":  # converted by speculators' own converters first
        case["convert"] = head.family
        case["layer_ids"] = engine_layer_ids(head.tap_layers, "speculators")
    return case, our_logits(head, target, make_batch(ids), anchors), expected_meta(head, target)


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict:
    """Max |difference| per output, max |logit|, top-1 agreement of the logits (shapes must match)."""
    out: dict[str, Any] = {}
    for k, a in ours.items():
        b = theirs.get(k)
        if b is None or b.shape != a.shape:
            raise AssertionError(f"{k}: speculators gave {None if b is None else list(b.shape)}, ours {list(a.shape)}")
        out[f"max_abs_diff_{k}" if k != "logits" else "max_abs_diff"] = (a.float() - b.float()).abs().max().item()
    a, b = ours["logits"].float(), theirs["logits"].float()
    out["max_abs_logit"] = a.abs().max().item()
    out["top1_agreement"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    out["positions"] = int(a[..., 0].numel())
    return out


@torch.no_grad()
def round_trip(head, target, export_dir: Path, fmt: str, target_name: str, ids: torch.Tensor,
               anchors: torch.Tensor | None, again_dir: Path) -> dict:
    """Export → import → same class, taps, weights and logits; → export again → same tensors (all bit-identical)."""
    from safetensors.torch import load_file

    from models.formats import export_draft, load_draft
    from models.target import FrozenTarget

    fresh = FrozenTarget(target_name, dtype="float32")  # a target as eval builds it (default taps): the import sets the draft's
    back = load_draft(export_dir, fresh).eval()
    a, b = head.state_dict(), back.state_dict()
    a = {k: v for k, v in a.items() if k in b or k not in head.decode_only_state}  # what the format may leave out
    weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    batch = make_batch(ids)
    ours = our_logits(head, target, batch, anchors)
    theirs = our_logits(back, fresh, batch, anchors)
    logits = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = export_draft(export_dir, fmt, again_dir)
    t1, t2 = load_file(str(export_dir / "model.safetensors")), load_file(str(again / "model.safetensors"))
    reexport = t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)
    res = {"same_class": type(back) is type(head), "same_taps": back.tap_layers == head.tap_layers,
           "weights_identical": bool(weights), "logits_identical": bool(logits), "reexport_identical": bool(reexport)}
    res["identical"] = all(res.values())
    return res


# -- the command ------------------------------------------------------------------------------------------
def text_ids(target_name: str, cfg: DictConfig) -> tuple[torch.Tensor, str]:
    """Token ids [1, T] of the check's text under the target's tokenizer, and where the text came from."""
    from models.target import load_tokenizer

    tok = load_tokenizer(target_name)
    T = int(cfg.tokens)
    if cfg.text:
        ids = tok(str(cfg.text), add_special_tokens=False)["input_ids"][:T]
        where = "text="
    else:
        from data.chat import tokenize_conversation
        from data.conversations import load_conversations

        ds = load_conversations(cfg.source, "heldout", cfg.heldout_fraction, verbose=False)
        ids, where = [], None
        for n in range(int(cfg.conversation), len(ds)):  # the first held-out conversation from this index long enough
            r = tokenize_conversation(tok, ds[n]["messages"], max_length=T, truncation="hard")
            if r and len(r["input_ids"]) >= T:
                ids, where = r["input_ids"], f"{cfg.source} held-out conversation {ds[n]['id']} (index {n})"
                break
        if where is None:
            raise UserError(f"{cfg.source}: no held-out conversation from index {cfg.conversation} has {T} tokens; lower tokens=")
    if len(ids) < 16:
        raise UserError(f"the check text has {len(ids)} tokens under {target_name}'s tokenizer; give a longer text= or tokens=")
    return torch.tensor(ids, dtype=torch.long)[None], where


def check_drafts(cfg: DictConfig) -> tuple[list[dict], int]:
    """Check every draft of ``cfg.drafts`` (see the module docstring) → (records, exit status)."""
    from models.formats import draft_family, export_draft, load_draft, load_export_target, resolve_draft_dir

    drafts = list(cfg.drafts or [])
    if not drafts:
        raise UserError("drafts: give the drafts to check, drafts=[runs/a,runs/b/draft] (run or draft directories)")
    out = Path(cfg.out)
    keep = bool(cfg.keep_exports)
    work = out / "exports" if keep else Path(tempfile.mkdtemp(prefix="check-export-"))
    work.mkdir(parents=True, exist_ok=True)
    fmt = "speculators"
    records, cases, pending, texts = [], [], {}, {}
    try:
        for n, d in enumerate(drafts):
            t0 = time.time()
            rec: dict[str, Any] = {"draft": str(d)}
            records.append(rec)
            try:
                src = resolve_draft_dir(d)
                family, identity = draft_family(src)
                rec["family"] = family
                name = f"{n}-{family}"
                local = cfg.verifier or local_verifier(identity)  # the side run loads the verifier: offline, a local folder
                exported = export_draft(src, fmt, work / f"{name}-{fmt}", verifier=local, dtype="float32")
            except UserError as e:
                rec["error"] = str(e)
                print(f"error: {d}: {e}", file=sys.stderr, flush=True)
                continue
            target_name = str(local or identity.get("name_or_path"))
            target = load_export_target(identity, local, src)
            head = load_draft(src, target).eval()
            if target_name not in texts:
                texts[target_name] = text_ids(target_name, cfg)
            ids, where = texts[target_name]
            blocks = FAMILIES[family].blocks
            anchors = default_anchors(ids.shape[1], head.block_size, int(cfg.anchors)) if blocks else None
            verifier = json.loads((exported / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
            case, ours, meta = make_case(name, head, target, exported, fmt, ids, anchors, work, verifier)
            cases.append(case)
            rec.update(target=target_name, text=where, tokens=int(ids.shape[1]),
                       anchors=None if anchors is None else anchors.tolist(),
                       round_trip=round_trip(head, target, exported, fmt, target_name, ids, anchors, work / f"{name}-again"))
            rec["prepare_seconds"] = round(time.time() - t0, 1)
            pending[name] = (rec, ours, meta)
        failed = refused = False
        if cases:
            t0 = time.time()
            side = run_side(cases, work)
            print(f"speculators side run: {len(cases)} drafts in {time.time() - t0:.0f}s", flush=True)
            for name, (rec, ours, meta) in pending.items():
                theirs, read = side[name]
                rec.update(speculators=compare(ours, theirs))
                rec["speculators"]["config_read"] = {k: read.get(k) for k in meta}
                rec["speculators"]["config_ok"] = {k: read.get(k) for k in meta} == meta
                rec["speculators"]["class"] = read.get("class")
        for rec in records:
            if "error" in rec:
                refused = True
                continue
            s = rec["speculators"]
            rec["ok"] = s["max_abs_diff"] <= cfg.atol and s["config_ok"] and rec["round_trip"]["identical"]
            failed |= not rec["ok"]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return records, 1 if failed else 2 if refused else 0


def summary(records: list[dict], atol: float) -> str:
    lines = [f"{'draft':40s} {'family':7s} {'max|Δlogit|':>11s} {'max|logit|':>10s} {'top-1':>6s} {'round trip':>10s}  verdict"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['draft']:40s} {r.get('family', '?'):7s} {'':43s}refused (the error line above)")
            continue
        s = r["speculators"]
        lines.append(f"{r['draft']:40s} {r['family']:7s} {s['max_abs_diff']:11.2e} {s['max_abs_logit']:10.2f} "
                     f"{s['top1_agreement']:6.1%} {'identical' if r['round_trip']['identical'] else 'DIFFERS':>10s}  "
                     f"{'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines) + f"\n(speculators {SIDE_PINS[1].split('==')[1]} vs ours, float32 on CPU; tolerance {atol:g})"


@hydra.main(config_path="../conf", config_name="check_export", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per target load otherwise
    t0 = time.time()
    records, status = check_drafts(cfg)
    result = {"speculators": SIDE_PINS[1].split("==")[1], "atol": cfg.atol, "seconds": round(time.time() - t0, 1),
              "config": OmegaConf.to_container(cfg, resolve=True), "drafts": records}
    write_json(Path(cfg.out) / "result.json", result)
    print(summary(records, cfg.atol))
    print(f"wrote {Path(cfg.out) / 'result.json'} ({result['seconds']:.0f}s)")
    if status:
        sys.exit(status)


if __name__ == "__main__":
    run_main(main)
