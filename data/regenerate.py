"""Rewrite the assistant turns of a conversation set with the target's own answers.

    python -m data.regenerate                                     # embedded target, ShareGPT train split
    python -m data.regenerate data.max_conversations=500 temperature=0 max_new_tokens=256 out_dir=runs/regen
    python -m data.regenerate data.max_conversations=500 first_conversation=1500   # the next 500 prompts
    python -m data.regenerate target=smollm2 target.dtype=float32 batch_size=256  # device=auto: a GPU when one is visible
    python -m data.regenerate endpoint=http://127.0.0.1:8000/v1 model=Qwen/Qwen3-8B concurrency=64 \
        "chat_template_kwargs={enable_thinking:false}" out_dir=runs/regen-qwen3      # a served model (vLLM, SGLang, ...)

Drafters learn best from the target's own outputs (DFlash, EAGLE-3). Turn by turn, every user turn is
kept and each assistant turn is replaced by the target's answer to the conversation so far (which
already holds its earlier answers). Two ways to get the answers:

- in process (the default; CPU-only machines): the target loaded here, batched generation with left padding;
- ``endpoint=<base URL>``: any OpenAI-compatible server (``POST <endpoint>/chat/completions``: vLLM, SGLang,
  ``transformers serve``), ``concurrency`` conversations in flight, each one request per turn. Sampling settings
  and ``chat_template_kwargs`` (reasoning on/off) go with every request; a reasoning answer the server returns
  apart (``reasoning_content``) is kept in front of the answer as ``<think>...</think>``.

Results go to JSONL shards ``out_dir/shard-<index of its first conversation>[-n].jsonl`` (a name no existing
shard has, so a rerun never writes over one), our ``{"id", "messages"}`` schema (readable as ``data.source``); each
shard is written to a temp file and renamed, and a rerun skips ids already in finished shards. The settings that
shape the answers (target or served model and endpoint, sampling, max_new_tokens, max_turns, prompt source,
template kwargs, seed) are recorded in ``out_dir/regenerate.json``; a rerun with other settings is refused (one set
holds one kind of answer). A data config's ``make:`` (``conf/data/embedded_regen.yaml``) has the first training run
that reads a missing set make it (:func:`make_source`: these shards, then one file).
"""
from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.conversations import load_conversations
from data.errors import UserError, atomic_file, cli, guard_out, run_main

SETTINGS_FILE = "regenerate.json"


def finished_ids(out_dir: Path) -> set[str]:
    """Ids in the finished shards of ``out_dir``; a cut-off or edited shard is one error naming its file and line."""
    done: set[str] = set()
    for shard in sorted(out_dir.glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8", newline="\n") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    done.add(str(rec["id"]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    why = e.msg if isinstance(e, json.JSONDecodeError) else "no id"
                    raise UserError(f"{shard}:{n}: malformed shard line ({why}); the file was cut off or edited: "
                                    "delete it and rerun (its conversations are answered again)") from None
    return done


def shard_path(out_dir: Path, index: int) -> Path:
    """``shard-<index>.jsonl``, or ``shard-<index>-<n>.jsonl`` with the first free n: never an existing shard."""
    path, n = out_dir / f"shard-{index:08d}.jsonl", 0
    while path.exists():
        n += 1
        path = out_dir / f"shard-{index:08d}-{n}.jsonl"
    return path


def template_kwargs(value: Any) -> dict:
    """``chat_template_kwargs`` from a config (null, a dict or a DictConfig) → a plain dict."""
    if value is None:
        return {}
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, dict):
        raise UserError(f"chat_template_kwargs={value!r}: give a mapping, e.g. {{enable_thinking: false}}")
    return {str(k): v for k, v in value.items()}


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, temperature: float,
                   top_p: float = 1.0, chat_template_kwargs: dict | None = None) -> list[str]:
    """Answer a batch of chats (each ending with a user turn); left-padded batched generation."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
             for p in prompts]
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
                             top_p: float, batch_size: int, max_turns: int | None = None, verbose: bool = False,
                             chat_template_kwargs: dict | None = None,
                             on_finished: Callable[[int], None] | None = None) -> list[dict]:
    """Replace every assistant turn (up to ``max_turns`` answers per chat) with the target's answer (in process,
    batched by turn); ``on_finished(n)`` is told each time n more conversations have all their answers."""
    chats = [[m for m in c["messages"] if m["role"] != "assistant"] for c in convs]
    results = [[] for _ in convs]
    users_done = [0] * len(convs)
    turn = 0
    finished = 0
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
        if on_finished is not None and len(convs) - len(active) > finished:
            on_finished(len(convs) - len(active) - finished)
            finished = len(convs) - len(active)
        if not active:
            break
        # similar lengths share a batch: less left padding
        active.sort(key=lambda i: sum(len(m["content"]) for m in results[i]))
        for s in range(0, len(active), batch_size):
            idx = active[s: s + batch_size]
            answers = generate_batch(model, tokenizer, [results[i] for i in idx], max_new_tokens, temperature, top_p,
                                     chat_template_kwargs)
            for i, a in zip(idx, answers):
                results[i].append({"role": "assistant", "content": a})
            if verbose:
                print(f"  turn {turn + 1}: {min(s + batch_size, len(active))}/{len(active)} answered", flush=True)
        turn += 1
    return [{"id": c["id"], "messages": r} for c, r in zip(convs, results) if any(m["role"] == "assistant" for m in r)]


class Endpoint:
    """An OpenAI-compatible chat completions server (``POST <base>/chat/completions``), standard library only."""

    RETRY_STATUS = (429, 502, 503, 504)  # overloaded or restarting: tried again, a few times

    def __init__(self, base: str, model: str | None, timeout_s: float = 600.0, retries: int = 3):
        self.base, self.timeout_s, self.retries = base.rstrip("/"), timeout_s, retries
        self.model = model or self.served_model()

    def _call(self, path: str, body: dict | None = None) -> dict:
        url = f"{self.base}{path}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return json.loads(r.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace").strip().replace("\n", " ")[:300]
                if e.code in self.RETRY_STATUS and attempt < self.retries:
                    time.sleep(2.0 ** attempt)
                    continue
                raise UserError(f"endpoint {url} answered HTTP {e.code}: {detail or e.reason}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(e, ConnectionResetError) and attempt < self.retries:
                    time.sleep(2.0 ** attempt)
                    continue
                raise UserError(f"endpoint {url} unreachable ({reason}); start the server (vllm serve, "
                                "python -m sglang.launch_server, transformers serve) or fix endpoint=") from None
            except json.JSONDecodeError:
                raise UserError(f"endpoint {url} did not answer JSON; endpoint= is the API base, e.g. "
                                "http://127.0.0.1:8000/v1") from None
        raise AssertionError("unreachable")

    def served_model(self) -> str:
        """The one model the server lists (``GET <base>/models``); several or none: ``model=`` must say which."""
        ids = [m.get("id") for m in self._call("/models").get("data", []) if isinstance(m, dict)]
        if len(ids) != 1:
            raise UserError(f"endpoint {self.base} serves {len(ids)} models ({', '.join(map(str, ids)) or 'none listed'}); "
                            "give model=<name served>")
        return str(ids[0])

    def answer(self, messages: list[dict], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               chat_template_kwargs: dict | None = None) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed, "stream": False}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        out = self._call("/chat/completions", body)
        try:
            msg = out["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"endpoint {self.base}/chat/completions: no choices[0].message in its answer "
                            f"({json.dumps(out)[:200]})") from None
        content = (msg.get("content") or "").strip()
        reasoning = (msg.get("reasoning_content") or msg.get("reasoning") or "").strip()
        return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


def request_seed(seed: int, cid: str, turn: int) -> int:
    """A per-request seed from (seed, conversation, turn): sampled answers do not depend on scheduling."""
    return int.from_bytes(hashlib.sha1(f"{seed}|{cid}|{turn}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def regenerate_one(endpoint: Endpoint, conv: dict, max_new_tokens: int, temperature: float, top_p: float,
                   max_turns: int | None, seed: int, chat_template_kwargs: dict | None = None) -> dict | None:
    """One conversation through the endpoint, turn by turn as :func:`regenerate_conversations` does."""
    history: list[dict] = []
    answered = 0
    for m in conv["messages"]:
        if m["role"] == "assistant":
            continue
        if m["role"] == "user" and max_turns is not None and answered >= max_turns:
            break
        history.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            a = endpoint.answer(history, max_new_tokens, temperature, top_p, request_seed(seed, conv["id"], answered),
                                chat_template_kwargs)
            history.append({"role": "assistant", "content": a})
            answered += 1
    return {"id": conv["id"], "messages": history} if answered else None


def regenerate_via_endpoint(endpoint: Endpoint, convs: Iterable[dict], concurrency: int, max_new_tokens: int,
                            temperature: float, top_p: float, max_turns: int | None, seed: int,
                            chat_template_kwargs: dict | None, on_done: Callable[[dict, dict | None], None]) -> None:
    """``concurrency`` conversations in flight; ``on_done(conversation, result)`` in the calling thread as each ends.
    The first error stops the run (requests in flight finish, nothing new is sent)."""
    it = iter(convs)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        running = {}

        def submit() -> bool:
            c = next(it, None)
            if c is None:
                return False
            running[pool.submit(regenerate_one, endpoint, c, max_new_tokens, temperature, top_p, max_turns, seed,
                                chat_template_kwargs)] = c
            return True

        while len(running) < concurrency and submit():
            pass
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                c = running.pop(fut)
                try:
                    result = fut.result()
                except BaseException:
                    for other in running:
                        other.cancel()
                    raise
                on_done(c, result)
                submit()


def override_value(v) -> str:
    """A Python value as Hydra's override grammar writes it (None → null, True → true, lists in brackets)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(override_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{override_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def flat(settings: dict, prefix: str = "") -> dict:
    """Nested keys → dotted ones: ``{"data": {"max_conversations": 9}}`` → ``{"data.max_conversations": 9}``;
    ``chat_template_kwargs`` stays one value (a mapping)."""
    out: dict = {}
    for k, v in settings.items():
        if isinstance(v, dict) and k != "chat_template_kwargs":
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
            text = shard.read_text(encoding="utf-8")
            f.write(text if not text or text.endswith("\n") else text + "\n")
    n = sum(1 for line in open(source, encoding="utf-8", newline="\n") if line.strip())
    print(f"{source}: {n} conversations from {len(shards)} shard(s)")


def settings_of(cfg: DictConfig) -> dict:
    """What shapes the answers: one set of shards holds answers made under one of these."""
    endpoint, src = cfg.get("endpoint"), cfg.data.source
    return {
        "answers_from": ({"endpoint": str(endpoint).rstrip("/"), "model": cfg.get("model")} if endpoint else
                         {"target": str(cfg.target.name_or_path), "dtype": str(cfg.target.get("dtype"))}),
        "temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "max_new_tokens": int(cfg.max_new_tokens),
        "max_turns": cfg.max_turns, "seed": int(cfg.seed),
        "chat_template_kwargs": template_kwargs(cfg.get("chat_template_kwargs")),
        "prompts": {"source": src if isinstance(src, str) else [str(x) for x in src], "split": cfg.split, "heldout_fraction": float(cfg.data.heldout_fraction),
                    "hub_split": cfg.data.get("hub_split", "train")},
    }


def answer_temperature(data_cfg: dict | None) -> float | None:
    """The temperature a training set's answers were sampled at, where it is known: its data config's ``make:``, else
    the ``regenerate.json`` of the shards beside a source file (``x.jsonl`` joined from ``x/`` or from its own folder).
    None: the dataset's own answers, or several sources made at different temperatures."""
    data_cfg = data_cfg or {}
    make = data_cfg.get("make") or {}
    if make.get("temperature") is not None:
        return float(make["temperature"])
    src = data_cfg.get("source")
    temps = set()
    for s in ([src] if isinstance(src, str) else list(src or [])):
        p = Path(str(s))
        if p.suffix != ".jsonl":
            return None  # a named dataset (sharegpt): its own answers
        for settings in (p.with_suffix("") / SETTINGS_FILE, p.parent / SETTINGS_FILE):
            try:
                temps.add(float(json.loads(settings.read_text(encoding="utf-8"))["temperature"]))
                break
            except (OSError, ValueError, KeyError, TypeError):
                continue
        else:
            return None
    return temps.pop() if len(temps) == 1 else None


def check_settings(out_dir: Path, settings: dict) -> None:
    """Record ``settings`` in ``out_dir/regenerate.json``; where shards are already there, refuse a run whose settings
    differ from the recorded ones (with no shard yet, the new settings replace them)."""
    path = out_dir / SETTINGS_FILE
    has_shards = any(out_dir.glob("shard-*.jsonl"))
    if path.exists() and has_shards:
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: malformed ({e.msg}); delete it only if every shard here was made with "
                            "this run's settings") from None
        diff = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
        if diff:
            said = "; ".join(f"{k}: {json.dumps(old.get(k))} there, {json.dumps(settings.get(k))} now" for k in diff)
            raise UserError(f"{out_dir} holds answers made with other settings ({said}); choose another out_dir "
                            "(one set holds one kind of answer)")
        return
    if has_shards:
        print(f"note: {out_dir} has shards but no {SETTINGS_FILE}; recording this run's settings as theirs")
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        json.dump(settings, f, indent=2)


@hydra.main(config_path="../conf", config_name="regenerate", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    guard_regen_out(cfg)
    run(cfg)


def guard_regen_out(cfg: DictConfig) -> Path:
    """``out_dir`` refused before any work unless it is empty or holds only what a regeneration writes (its shards and
    settings file: a stopped run resumes there)."""
    return guard_out(cfg.out_dir, "out_dir", ("shard-*.jsonl", ".shard-*", SETTINGS_FILE),
                     overwrite=bool(cfg.get("overwrite")), what="regenerated shards of ours")


class ConversationProgress:
    """Conversations done, conversations/s and time left (:class:`data.progress.Progress`: a tqdm bar on a terminal,
    a line every 30 s on a pipe or a log)."""

    def __init__(self, total: int):
        from data.progress import Progress

        self.p, self.t0 = Progress(total, "regenerate", unit="conv"), time.perf_counter()

    def update(self, n: int = 1) -> None:
        rate = (self.p.n + n) / max(time.perf_counter() - self.t0, 1e-9)
        self.p.update(n, note=f"{rate:.2f} conv/s")

    def close(self) -> None:
        self.p.close()


def run(cfg: DictConfig) -> Path:
    """Regenerate into ``cfg.out_dir`` (shards; finished ids skipped) → that directory."""
    from models.target import load_tokenizer, resolve_device

    if cfg.temperature < 0:
        raise UserError(f"temperature={cfg.temperature}: must be >= 0")
    if not 0 < cfg.top_p <= 1:
        raise UserError(f"top_p={cfg.top_p}: must be in (0, 1]")
    if cfg.first_conversation < 0:
        raise UserError(f"first_conversation={cfg.first_conversation}: must be >= 0 (an index into the {cfg.split} split)")
    if cfg.shard_size < 1 or cfg.get("concurrency", 1) < 1:
        raise UserError("shard_size and concurrency must be >= 1")
    kwargs = template_kwargs(cfg.get("chat_template_kwargs"))
    out_dir = Path(cfg.out_dir)
    device = None if cfg.get("endpoint") else resolve_device(cfg.device)
    endpoint = Endpoint(cfg.endpoint, cfg.get("model"), cfg.get("timeout_s", 600)) if cfg.get("endpoint") else None
    settings = settings_of(cfg)
    if endpoint is not None:
        settings["answers_from"]["model"] = endpoint.model
    ds = load_conversations(cfg.data.source, cfg.split, cfg.data.heldout_fraction, hub_split=cfg.data.get("hub_split", "train"))
    check_settings(out_dir, settings)
    first = cfg.first_conversation
    if first > len(ds):
        raise UserError(f"first_conversation={first}: the {cfg.split} split has {len(ds)} conversations")
    last = min(first + cfg.data.max_conversations, len(ds)) if cfg.data.max_conversations else len(ds)
    if (first, last) != (0, len(ds)):
        ds = ds.select(range(first, last))
    done = finished_ids(out_dir)
    todo = [{"id": r["id"], "messages": r["messages"], "index": first + i} for i, r in enumerate(ds) if r["id"] not in done]
    tok = load_tokenizer(cfg.target.name_or_path) if endpoint is None or cfg.max_prompt_tokens else None
    if cfg.max_prompt_tokens:  # a first prompt longer than this is skipped (it would dominate a batch's cost)
        def first_prompt_len(c: dict) -> int:
            first = next(i for i, m in enumerate(c["messages"]) if m["role"] == "user")
            text = tok.apply_chat_template(c["messages"][: first + 1], tokenize=False, add_generation_prompt=True, **kwargs)
            return len(tok(text, add_special_tokens=False)["input_ids"])
        kept = [c for c in todo if first_prompt_len(c) <= cfg.max_prompt_tokens]
        print(f"regenerate: {len(todo) - len(kept)} conversations skipped (first prompt > {cfg.max_prompt_tokens} "
              f"tokens of {cfg.target.name_or_path}'s template)")
        todo = kept
    how = f"endpoint {endpoint.base} ({endpoint.model})" if endpoint else f"{cfg.target.name_or_path} in process"
    print(f"regenerate: {len(done)} already done, {len(todo)} to do -> {out_dir} (answers from {how})", flush=True)

    def write_shard(part: list[dict], index: int) -> None:
        if not part:
            return
        path = shard_path(out_dir, index)
        with atomic_file(path) as f:
            for c in part:
                f.write(json.dumps({"id": c["id"], "messages": c["messages"]}, ensure_ascii=False) + "\n")

    bar = ConversationProgress(len(todo))
    try:
        if endpoint is not None:
            pending: list[tuple[int, dict]] = []

            def on_done(conv: dict, result: dict | None) -> None:
                bar.update(1)
                if result is not None:
                    pending.append((conv["index"], result))
                if len(pending) >= cfg.shard_size:
                    write_shard([r for _, r in sorted(pending, key=lambda p: p[0])], min(i for i, _ in pending))
                    pending.clear()

            try:
                regenerate_via_endpoint(endpoint, todo, cfg.concurrency, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                        cfg.max_turns, cfg.seed, kwargs, on_done)
            finally:  # answers received before an error or an interrupt are kept
                if pending:
                    write_shard([r for _, r in sorted(pending, key=lambda p: p[0])], min(i for i, _ in pending))
        else:
            from transformers import AutoModelForCausalLM

            from models.target import resolve_dtype, resolve_path

            model = AutoModelForCausalLM.from_pretrained(resolve_path(cfg.target.name_or_path),
                                                         dtype=resolve_dtype(cfg.target.dtype)).eval().to(device)
            torch.manual_seed(cfg.seed)
            for s in range(0, len(todo), cfg.shard_size):
                chunk = todo[s: s + cfg.shard_size]
                part = regenerate_conversations(model, tok, chunk, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                                cfg.batch_size, cfg.max_turns, chat_template_kwargs=kwargs,
                                                on_finished=bar.update)
                write_shard(part, chunk[0]["index"])
    finally:
        bar.close()
    return out_dir


if __name__ == "__main__":
    run_main(main)
