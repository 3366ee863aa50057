"""Rewrite the assistant turns of a conversation set with the target's own answers.

    python -m data.regenerate                                     # embedded target, ShareGPT train split
    python -m data.regenerate data.max_conversations=500 temperature=0 max_new_tokens=256 out_dir=runs/regen
    python -m data.regenerate data.max_conversations=500 first_conversation=1500   # the next 500 prompts
    python -m data.regenerate target=smollm2 target.dtype=float32 batch_size=256  # device=auto: a GPU when one is visible

Drafters learn best from the target's own outputs (DFlash, EAGLE-3). Turn by turn, every user turn is
kept and each assistant turn is replaced by the target's answer to the conversation so far (which
already holds its earlier answers). Generation is batched (left padding). Results go to JSONL shards
``out_dir/shard-XXXXX.jsonl`` (our ``{"id", "messages"}`` schema, readable as ``data.source``); each
shard is written to a temp file and renamed, and a rerun skips ids already in finished shards. A data config's
``make:`` (``conf/data/embedded_regen.yaml``) has the first training run that reads a missing set make it
(:func:`make_source`: these shards, then one file).
"""
from __future__ import annotations

import json
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.conversations import load_conversations
from data.errors import UserError, atomic_file, cli, guard_out, run_main


def finished_ids(out_dir: Path) -> set[str]:
    done: set[str] = set()
    for shard in sorted(out_dir.glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    done.add(json.loads(line)["id"])
    return done


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, temperature: float,
                   top_p: float = 1.0) -> list[str]:
    """Answer a batch of chats (each ending with a user turn); left-padded batched generation."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        kwargs.update(do_sample=False)
    out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def regenerate_conversations(model, tokenizer, convs: list[dict], max_new_tokens: int, temperature: float,
                             top_p: float, batch_size: int, max_turns: int | None = None, verbose: bool = False) -> list[dict]:
    """Replace every assistant turn (up to ``max_turns`` answers per chat) with the target's answer."""
    chats = [[m for m in c["messages"] if m["role"] != "assistant"] for c in convs]
    results = [[] for _ in convs]
    users_done = [0] * len(convs)
    turn = 0
    while True:
        # advance each chat to its next user turn; chats with no user turn left are finished
        active = []
        for i, msgs in enumerate(chats):
            if max_turns is not None and turn >= max_turns:
                break
            j = users_done[i]
            while j < len(msgs) and msgs[j]["role"] != "user":
                results[i].append(msgs[j])  # system turns
                j += 1
            if j < len(msgs):
                results[i].append(msgs[j])
                users_done[i] = j + 1
                active.append(i)
        if not active:
            break
        # similar lengths share a batch: less left padding
        active.sort(key=lambda i: sum(len(m["content"]) for m in results[i]))
        for s in range(0, len(active), batch_size):
            idx = active[s: s + batch_size]
            answers = generate_batch(model, tokenizer, [results[i] for i in idx], max_new_tokens, temperature, top_p)
            for i, a in zip(idx, answers):
                results[i].append({"role": "assistant", "content": a})
            if verbose:
                print(f"  turn {turn + 1}: {min(s + batch_size, len(active))}/{len(active)} answered", flush=True)
        turn += 1
    return [{"id": c["id"], "messages": r} for c, r in zip(convs, results) if any(m["role"] == "assistant" for m in r)]


def override_value(v) -> str:
    """A Python value as Hydra's override grammar writes it (None → null, True → true, lists in brackets)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(override_value(x) for x in v) + "]"
    return str(v)


def flat(settings: dict, prefix: str = "") -> dict:
    """Nested keys → dotted ones: ``{"data": {"max_conversations": 9}}`` → ``{"data.max_conversations": 9}``."""
    out: dict = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def make_source(source: str | Path, settings: dict) -> None:
    """Write the conversation file ``source`` (JSONL) with the target's answers: ``python -m data.regenerate`` under
    ``settings`` (its config keys, e.g. ``{"target": "embedded", "temperature": 1}``; ``out_dir``, where the shards
    go, defaults to ``source`` without its suffix), then the shards joined into ``source``, which is written whole
    or not at all. Resumable as the command is: a rerun skips the shards already written."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    source = Path(source)
    settings = {"out_dir": str(source.with_suffix("")), **settings}
    overrides = [f"{k}={override_value(v)}" for k, v in flat(settings).items()]
    print(f"{source}: missing; making it: python -m data.regenerate {' '.join(overrides)} "
          "(resumable: an interrupted run continues where it stopped)", flush=True)
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (python -m train): its config search path
        cfg = compose("regenerate", overrides=overrides)
    else:
        with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
            cfg = compose("regenerate", overrides=overrides)
    with torch.random.fork_rng(devices=[]):  # the caller's random state (a training run's seed) as it was
        out_dir = run(cfg)
    shards = sorted(out_dir.glob("shard-*.jsonl"))
    if not shards:
        raise UserError(f"{source}: data.regenerate wrote no answers to {out_dir} (no prompt left after its filters)")
    with atomic_file(source) as f:
        for shard in shards:
            f.write(shard.read_text(encoding="utf-8"))
    print(f"{source}: {sum(1 for _ in open(source, encoding='utf-8'))} conversations from {len(shards)} shard(s)")


@hydra.main(config_path="../conf", config_name="regenerate", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    guard_out(cfg.out_dir, "out_dir", ("shard-*.jsonl", ".shard-*"), overwrite=bool(cfg.get("overwrite")), what="regenerated shards of ours")
    run(cfg)


def run(cfg: DictConfig) -> Path:
    """Regenerate into ``cfg.out_dir`` (shards; finished ids skipped) → that directory."""
    from transformers import AutoModelForCausalLM

    from models.target import load_tokenizer, resolve_device, resolve_dtype, resolve_path

    if cfg.temperature < 0:
        raise UserError(f"temperature={cfg.temperature}: must be >= 0")
    if cfg.first_conversation < 0:
        raise UserError(f"first_conversation={cfg.first_conversation}: must be >= 0 (an index into the {cfg.split} split)")
    device = resolve_device(cfg.device)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.target.name_or_path)
    model = AutoModelForCausalLM.from_pretrained(resolve_path(cfg.target.name_or_path),
                                                 dtype=resolve_dtype(cfg.target.dtype)).eval().to(device)
    torch.manual_seed(cfg.seed)
    ds = load_conversations(cfg.data.source, cfg.split, cfg.data.heldout_fraction)
    first = cfg.first_conversation
    if first > len(ds):
        raise UserError(f"first_conversation={first}: the {cfg.split} split has {len(ds)} conversations")
    last = min(first + cfg.data.max_conversations, len(ds)) if cfg.data.max_conversations else len(ds)
    if (first, last) != (0, len(ds)):
        ds = ds.select(range(first, last))
    done = finished_ids(out_dir)
    todo = [{"id": r["id"], "messages": r["messages"]} for r in ds if r["id"] not in done]
    if cfg.max_prompt_tokens:  # a first prompt longer than this is skipped (it would dominate a batch's cost)
        def first_prompt_len(c: dict) -> int:
            first = next(i for i, m in enumerate(c["messages"]) if m["role"] == "user")
            text = tok.apply_chat_template(c["messages"][: first + 1], tokenize=False, add_generation_prompt=True)
            return len(tok(text, add_special_tokens=False)["input_ids"])
        kept = [c for c in todo if first_prompt_len(c) <= cfg.max_prompt_tokens]
        print(f"regenerate: {len(todo) - len(kept)} conversations skipped (first prompt > {cfg.max_prompt_tokens} tokens)")
        todo = kept
    print(f"regenerate: {len(done)} already done, {len(todo)} to do -> {out_dir}")
    n_shards = len(list(out_dir.glob("shard-*.jsonl")))
    for s in range(0, len(todo), cfg.shard_size):
        part = regenerate_conversations(model, tok, todo[s: s + cfg.shard_size], cfg.max_new_tokens, cfg.temperature,
                                        cfg.top_p, cfg.batch_size, cfg.max_turns, verbose=True)
        with atomic_file(out_dir / f"shard-{n_shards:05d}.jsonl") as f:
            for c in part:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
        n_shards += 1
        print(f"shard {n_shards - 1}: {len(part)} conversations ({s + len(part)}/{len(todo)})")
    return out_dir


if __name__ == "__main__":
    run_main(main)
