"""Held-out prompt sets for acceptance evaluation (``conf/eval_set``): each yields conversations whose user
turns are prompts; with ``follow_turns`` later user turns follow the target's own earlier answers (MT-Bench).

JSONL schema (``JsonlSet``): one object per line, either ``{"id"?, "prompt": "..."}`` or a conversation
``{"id"?, "messages"|"conversations": [...]}`` in the formats of :mod:`data.conversations`; assistant
turns in a conversation are ignored (the target answers every user turn).
"""
from __future__ import annotations

import json
from pathlib import Path

from data.errors import UserError


class PromptSet:
    name = "set"

    def __init__(self, limit: int | None = None, follow_turns: bool = True, max_turns: int = 2):
        self.limit, self.follow_turns, self.max_turns = limit, follow_turns, max_turns

    def load(self) -> list[dict]:
        raise NotImplementedError

    def conversations(self) -> list[dict]:
        """``[{"id", "turns": [user prompt, ...]}]`` (system turns kept as ``system``)."""
        out = []
        for c in self.load():
            users = [m["content"] for m in c["messages"] if m["role"] == "user"]
            system = next((m["content"] for m in c["messages"] if m["role"] == "system"), None)
            if not users:
                continue
            turns = users[: self.max_turns] if self.follow_turns else users[:1]
            out.append({"id": c["id"], "turns": turns, "system": system})
            if self.limit and len(out) >= self.limit:
                break
        return out


class MTBench(PromptSet):
    """MT-Bench, 80 questions with two turns; the second follows the target's own first answer."""

    name = "mtbench"

    def load(self) -> list[dict]:
        from data.benchmarks import mt_bench

        return mt_bench()


class HumanEval(PromptSet):
    """HumanEval, 164 function-completion prompts (one turn)."""

    name = "humaneval"

    def load(self) -> list[dict]:
        from data.benchmarks import humaneval

        return humaneval()


class ShareGPTHeldout(PromptSet):
    """The held-out split of a conversation source (by id hash, as in training)."""

    name = "sharegpt"

    def __init__(self, source: str = "sharegpt", heldout_fraction: float = 0.02, **kw):
        super().__init__(**kw)
        self.source, self.heldout_fraction = source, heldout_fraction

    def load(self) -> list[dict]:
        from data.conversations import load_conversations

        ds = load_conversations(self.source, "heldout", self.heldout_fraction, verbose=False)
        n = min(len(ds), (self.limit or len(ds)) * 2)
        return [{"id": r["id"], "messages": r["messages"]} for r in ds.select(range(n))]


class JsonlSet(PromptSet):
    """Any JSONL file of prompts or conversations (schema in the module docstring)."""

    def __init__(self, path: str, name: str | None = None, **kw):
        super().__init__(**kw)
        self.path = Path(path)
        self.name = name or self.path.stem

    def load(self) -> list[dict]:
        from data.conversations import normalize_record

        if not self.path.exists():
            raise UserError(f"{self.path}: no such prompt file (give eval_set.path=<file.jsonl>)")
        out = []
        try:
            lines = self.path.read_bytes().decode("utf-8").split("\n")  # not splitlines: U+2028/U+2029 may sit in a string
        except UnicodeDecodeError as e:
            line_no = self.path.read_bytes()[: e.start].count(b"\n") + 1
            raise UserError(f"{self.path}:{line_no}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
        except IsADirectoryError:
            raise UserError(f"{self.path}: is a directory, not a prompt file (give eval_set.path=<file.jsonl>)") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{self.path}:{n}: malformed JSON ({e.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and not rec["prompt"].strip():
                raise UserError(f"{self.path}:{n}: blank prompt (\"prompt\" holds only whitespace)")
            if isinstance(rec, dict) and isinstance(rec.get("messages", rec.get("conversations")), list):
                for i, t in enumerate(rec.get("messages", rec.get("conversations"))):
                    if (isinstance(t, dict) and str(t.get("role", t.get("from", ""))).lower() in ("user", "human")
                            and not str(t.get("content", t.get("value")) or "").strip()):
                        raise UserError(f"{self.path}:{n}: blank user turn (turn {i} holds no text)")
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                out.append({"id": str(rec.get("id", f"{self.name}-{n}")),
                            "messages": [{"role": "user", "content": rec["prompt"]}]})
                continue
            if isinstance(rec, dict):  # a conversation; assistant turns are optional here
                turns = rec.get("messages", rec.get("conversations"))
                if isinstance(turns, list):
                    rec2 = {"id": rec.get("id", f"{self.name}-{n}"), "messages": turns + [{"role": "assistant", "content": "-"}]}
                    conv, reason = normalize_record(rec2, n)
                    if conv:
                        out.append(conv)
                        continue
                    raise UserError(f"{self.path}:{n}: unusable conversation ({reason})")
            raise UserError(f"{self.path}:{n}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}}")
        if not out:
            raise UserError(f"{self.path}: no prompts in the file")
        return out


class PromptLengthPolicy:
    """Prompts longer than the target's context: the policy of ``python -m eval`` (``max_prompt_tokens``).

    A prompt (chat template applied, history included) longer than ``max_prompt_tokens`` keeps its last
    ``max_prompt_tokens`` tokens (truncated from the left: the question's end and the generation prompt stay).
    ``max_prompt_tokens: null`` is the target's ``max_position_embeddings`` minus ``max_new_tokens + k + 1``
    (room to generate and verify); a value beyond that, or no room at all, is refused. Truncated prompts are
    counted per set (``protocol.truncated_prompts`` in results.json)."""

    def __init__(self, max_prompt_tokens: int | None, context: int | None, max_new_tokens: int, k: int):
        room = None if not context else int(context) - int(max_new_tokens) - int(k) - 1
        if room is not None and room < 1:
            raise UserError(f"max_new_tokens={max_new_tokens} with k={k} leaves no room for a prompt in the target's "
                            f"context of {context} tokens")
        if max_prompt_tokens is not None:
            if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
                raise UserError(f"max_prompt_tokens={max_prompt_tokens}: must be an integer >= 1 (or null: the target's context)")
            if room is not None and max_prompt_tokens > room:
                raise UserError(f"max_prompt_tokens={max_prompt_tokens}: with max_new_tokens={max_new_tokens} and k={k} it exceeds "
                                f"the target's context of {context} tokens (at most {room})")
        self.limit = max_prompt_tokens if max_prompt_tokens is not None else room
        self.truncated: dict[str, set] = {}

    def __call__(self, ids, key: tuple):
        """``ids`` [T] cut to the last ``limit`` tokens; ``key`` = (set name, prompt, turn) is counted once."""
        if self.limit is None or len(ids) <= self.limit:
            return ids
        self.truncated.setdefault(str(key[0]), set()).add(tuple(key[1:]))
        return ids[-self.limit:]

    def counts(self) -> dict[str, int]:
        return {name: len(v) for name, v in self.truncated.items()}
