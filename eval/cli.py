"""``draftsmith``: one command with a subcommand per job; each takes the Hydra overrides of its ``python -m`` module.

    draftsmith train experiment=eagle3_quick          # = python -m train experiment=eagle3_quick
    draftsmith eval target=smollm2 limit=2             # = python -m eval target=smollm2 limit=2
    draftsmith train --help                            # Hydra's help for that job: its config groups and keys
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module whose ``main`` is the Hydra entry point, one line for the help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train.__main__", "train a draft head (online or from a feature cache); resume with ckpt_path=last"),
    "eval": ("eval.__main__", "speculative decoding against plain decoding: tau, acceptance, speed-up"),
    "export": ("train.export", "export a trained head to a serving format (vLLM/speculators, SGLang)"),
    "features": ("data.features", "extract the target's hidden states into an offline feature cache"),
    "regenerate": ("data.regenerate", "regenerate a dataset's answers with the target"),
    "prepare": ("data.prepare", "tokenise a dataset with the target's chat template and loss mask"),
    "compare": ("eval.compare", "train and evaluate several families on one budget, one table"),
    "curve": ("eval.curve", "evaluate a run's checkpoints: validation acceptance against decoded tau"),
    "plan": ("eval.planner", "the target's verify cost curve and the draft length that pays"),
    "datastore": ("eval.datastore", "build a retrieval datastore of the target's own answers"),
    "ship": ("train.ship", "package a trained head (bf16) with its report, fit to ship"),
    "card": ("train.card", "write the model card (README.md) of an exported head"),
    "results": ("eval.results", "render docs/results.md from the measurements' JSON (check=true: verify it)"),
    "check-export": ("eval.check_export", "load exports with the speculators library and compare logits"),
    "quickstart": ("eval.quickstart", "the end-to-end demo on a CPU: train, then evaluate SmolLM2's shipped head"),
    "gpu-check": ("eval.gpu_check", "the whole path on this machine's GPU (regenerate, features, train, eval, export)"),
    "embedded-target": ("train.embedded_target", "rebuild the small embedded target from scratch"),
    "bench-decode": ("eval.bench_decode", "developer benchmark: the decoder's time split and kernels"),
    "bench-train": ("eval.bench_train", "developer benchmark: training steps per second"),
    "bench-ties": ("eval.bench_ties", "developer benchmark: numerical ties at reduced precision"),
    "agreement": ("eval.agreement", "developer check: teacher-forced acceptance against decoding's"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: draftsmith <command> [key=value ...]   (Hydra overrides; `draftsmith <command> --help` lists them)",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    from data.errors import run_main

    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"draftsmith {name}", *rest]  # Hydra reads its overrides from sys.argv
    run_main(module.main)


if __name__ == "__main__":
    main()
