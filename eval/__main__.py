"""``python -m eval``: acceptance and speed-up of drafters on held-out sets, beside plain decoding.

    python -m eval                                            # n-gram + the EAGLE-3 run of `python -m train`
    python -m eval drafters.eagle3.path=runs/eagle3-quick/draft eval_set=[mtbench] limit=10
    python -m eval eval_set=[jsonl] eval_set.jsonl.path=my_prompts.jsonl temperatures=[0]
    python -m eval device=cuda:1                              # the target and the trained heads on that GPU (default: auto)
    python -m eval +drafters.eagle3_tree='{_target_: eval.decoding.drafters.load_head, path: runs/eagle3-embedded/draft, tree: {budget: 16, depth: 6, topk: 4}}'

Writes ``results.json``, ``results.md`` (the table, with the protocol) and ``acceptance.png`` into the run
directory and prints the table.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from data.errors import cli, instantiate, run_main


def run(cfg: DictConfig) -> dict:
    from eval.decoding.drafters import build_drafter
    from eval.run import Journal, build_sets, count_defects, evaluate, log_results, protocol_of, write_report
    from models.target import load_tokenizer
    target = instantiate(cfg.target, device=cfg.get("device", "auto"))  # auto: a GPU when one is visible
    tok = load_tokenizer(cfg.target.name_or_path)
    from eval.sets import PromptLengthPolicy

    drafters = {name: build_drafter(node, target, name) for name, node in (cfg.drafters or {}).items() if node is not None}
    policy = PromptLengthPolicy(cfg.get("max_prompt_tokens"), getattr(target.config, "max_position_embeddings", None),
                                cfg.max_new_tokens, max([draft_room(d, cfg.k) for d in drafters.values()] or [draft_room(None, cfg.k)]))
    sets = build_sets(cfg)
    template = {"chat_template_kwargs": dict(cfg.chat_template_kwargs)} if cfg.get("chat_template_kwargs") else {}
    protocol = protocol_of(cfg, tok, drafters, dtype=str(next(target.parameters()).dtype).replace("torch.", ""),
                           device=str(target.device), **template)
    journal = Journal(Path(cfg.out_dir) / "journal.jsonl", protocol, bool(cfg.get("resume", False)))
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
