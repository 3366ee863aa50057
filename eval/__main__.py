"""``python -m eval``: acceptance and speed-up of drafters on held-out sets, beside plain decoding.

    python -m eval                                            # n-gram + the EAGLE-3 run of `python -m train`
    python -m eval drafters.eagle3.path=runs/eagle3-quick/draft eval_set=[mtbench] limit=10
    python -m eval eval_set=[jsonl] eval_set.jsonl.path=my_prompts.jsonl temperatures=[0]
    python -m eval device=cuda:1                              # the target and the trained heads on that GPU (default: auto)
    python -m eval +drafters.eagle3_tree='{_target_: eval.decoding.drafters.load_head, path: runs/eagle3-embedded/draft, tree: {budget: 16, depth: 6, topk: 4}}'

Writes ``results.json``, ``results.md`` (the table, with the protocol) and ``acceptance.png`` into the run
directory and prints the table. The decoding settings and ``out_dir`` are checked before anything is loaded or
generated: an ``out_dir`` that holds other files than an evaluation's (unless ``overwrite=true``) or cannot be
written is one ``error:`` line.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig

from data.errors import UserError, cli, guard_out, instantiate, run_main

EVAL_FILES = ("results.json", "results.md", "acceptance.png", "journal.jsonl", "logs", "tb", "wandb", ".hydra", "*.log",
              ".*.tmp*")  # what out_dir holds (logs, tb, wandb: the loggers' folders)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_eval_config(cfg: Any) -> None:
    """The decoding settings of ``python -m eval`` (and of eval.compare / eval.curve, before their training),
    checked where they are read, each a one-line UserError: ``temperatures`` a non-empty list of finite numbers
    >= 0 (a NaN would sample the last token forever), ``limit`` null (every prompt) or >= 1, ``k`` an integer >= 1
    or auto, ``max_new_tokens`` >= 1, ``top_p`` in (0, 1], ``seed`` an integer >= 0."""
    temps = cfg.get("temperatures")
    if not isinstance(temps, (list, tuple, ListConfig)) or not temps:
        raise UserError(f"temperatures={temps}: give a non-empty list of sampling temperatures, e.g. temperatures=[0,1]")
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperatures={list(temps)}: {t} is not a temperature (a finite number >= 0; 0 is greedy)")
    limit = cfg.get("limit")
    if limit is not None and (not _int(limit) or limit < 1):
        raise UserError(f"limit={limit}: prompts per set, an integer >= 1, or null for every prompt")
    k = cfg.get("k")
    if k != "auto" and (not _int(k) or k < 1):
        raise UserError(f"k={k}: the draft length must be an integer >= 1, or auto")
    n = cfg.get("max_new_tokens")
    if not _int(n) or n < 1:
        raise UserError(f"max_new_tokens={n}: an integer >= 1")
    top_p = cfg.get("top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p}: a number in (0, 1]")
    seed = cfg.get("seed")
    if not _int(seed) or seed < 0:
        raise UserError(f"seed={seed}: an integer >= 0")


def run(cfg: DictConfig) -> dict:
    check_eval_config(cfg)
    guard_out(cfg.out_dir, "out_dir", EVAL_FILES, overwrite=bool(cfg.get("overwrite")), what="an evaluation of ours")
    from eval.decoding.drafters import build_drafter, temperature_notes
    from eval.run import Journal, build_sets, count_defects, evaluate, log_results, protocol_of, write_report
    from models.target import load_tokenizer
    target = instantiate(cfg.target, device=cfg.get("device", "auto"))  # auto: a GPU when one is visible
    tok = load_tokenizer(cfg.target.name_or_path)
    from eval.sets import PromptLengthPolicy

    drafters = {name: build_drafter(node, target, name) for name, node in (cfg.drafters or {}).items() if node is not None}
    for note in temperature_notes(drafters, list(cfg.temperatures)):
        print(note, file=sys.stderr)
    policy = PromptLengthPolicy(cfg.get("max_prompt_tokens"), getattr(target.config, "max_position_embeddings", None),
                                cfg.max_new_tokens, max([draft_room(d, cfg.k) for d in drafters.values()] or [draft_room(None, cfg.k)]))
    sets = build_sets(cfg)
    template = {"chat_template_kwargs": dict(cfg.chat_template_kwargs)} if cfg.get("chat_template_kwargs") else {}
    protocol = protocol_of(cfg, tok, drafters, dtype=str(next(target.parameters()).dtype).replace("torch.", ""),
                           device=str(target.device), **template)
    journal = Journal(Path(cfg.out_dir) / "journal.jsonl", protocol, bool(cfg.get("resume", False)),
                      bool(cfg.get("overwrite", False)))
    results = evaluate(target, tok, drafters, sets, list(cfg.temperatures), cfg.k, cfg.max_new_tokens, cfg.top_p, cfg.seed,
                       tie_ulps=cfg.tie_ulps, prompt_policy=policy, journal=journal,
                       chat_template_kwargs=cfg.get("chat_template_kwargs"))
    protocol.update(max_prompt_tokens=policy.limit, truncated_prompts=policy.counts())
    if policy.counts():
        print(f"note: prompts longer than max_prompt_tokens={policy.limit} were truncated from the left: "
              + ", ".join(f"{n} in {s}" for s, n in policy.counts().items()))
    table = write_report(results, protocol, Path(cfg.out_dir))
    log_results(cfg.get("logger"), results, protocol)
    print(table)
    print(f"wrote {cfg.out_dir}/results.json, results.md, acceptance.png")
    defects = count_defects(results)
    if defects:  # a greedy output that differs from plain decoding beyond a numerical tie: the decoder is not lossless
        print(f"error: {defects} greedy generation(s) differ from plain decoding by more than a numerical tie "
              f"(see 'divergences' in {cfg.out_dir}/results.json)", file=sys.stderr)
        sys.exit(1)
    return results


def draft_room(drafter, k) -> int:
    """Cache positions one verify pass may add beyond the context: a tree's budget, else the drafter's k (auto: 8)."""
    tree = getattr(drafter, "tree_spec", None)
    k = getattr(drafter, "draft_k", k)
    return tree.budget if tree is not None else (8 if k == "auto" else int(k))


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    run_main(main)
