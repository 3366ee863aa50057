"""Acceptance evaluation: every drafter beside plain decoding, on the same prompts, side by side in one run.

For each prompt set, temperature and prompt, plain decoding runs first and then each drafter, so that
wall-clock ratios (speed-up) come from interleaved runs on the same prompts. Multi-turn sets feed the
target's own answer of turn i (plain decoding's, the same for every drafter) into turn i+1. Results: τ,
per-position conditional acceptance, the histogram of accepted lengths, tokens/s, speed-up over plain
decoding, the time split (draft, verify, prefill, the decoder's own work), and at T=0 whether the output is identical to plain decoding: each
divergence is classified by :mod:`eval.decoding.lossless` as a numerical tie (a near-tied argmax flipped by
reduced-precision arithmetic) or a defect; defects fail the run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError, instantiate
from data.progress import Progress
from eval.decoding.decoder import GenStats, NoDrafter, Sampler, SpeculativeDecoder
from eval.decoding.lossless import classify
from eval.decoding.drafters import auto_k_factory


@dataclass
class Agg:
    """Statistics of one drafter on one (set, temperature), summed over prompts and turns."""

    new_tokens: int = 0
    passes: int = 0
    verified: int = 0
    drafted: int = 0
    hist: dict[int, int] = field(default_factory=dict)
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_prefill: float = 0.0
    t_total: float = 0.0
    generations: int = 0
    identical: int = 0
    ties: int = 0
    defects: int = 0
    divergences: list[dict] = field(default_factory=list)

    def add(self, st: GenStats) -> None:
        self.new_tokens += st.new_tokens
        self.passes += st.passes
        self.verified += st.verified_tokens
        self.drafted += st.drafted
        for a in st.accepted_hist:
            self.hist[a] = self.hist.get(a, 0) + 1
        self._add_at(st.proposed_at, st.accepted_at)
        self.t_draft += st.t_draft
        self.t_verify += st.t_verify
        self.t_prefill += st.t_prefill
        self.t_total += st.t_total
        self.generations += 1

    def merge(self, other: "Agg") -> None:
        """Add another Agg's sums (one prompt's statistics, e.g. read back from the journal on resume)."""
        for f in ("new_tokens", "passes", "verified", "drafted", "t_draft", "t_verify", "t_prefill", "t_total",
                  "generations", "identical", "ties", "defects"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for a, c in other.hist.items():
            self.hist[a] = self.hist.get(a, 0) + c
        self._add_at(other.proposed_at, other.accepted_at)
        self.divergences += other.divergences

    def _add_at(self, proposed: list[int], accepted: list[int]) -> None:
        """Per-position counts: drafts that reached position i, and those of them accepted."""
        for i, (p, a) in enumerate(zip(proposed, accepted)):
            while len(self.proposed_at) <= i:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += p
            self.accepted_at[i] += a

    def as_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        d["hist"] = {str(k): v for k, v in self.hist.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Agg":
        d = dict(d)
        d["hist"] = {int(k): v for k, v in d.get("hist", {}).items()}
        return cls(**d)

    def summary(self, plain: "Agg | None") -> dict:
        tps = self.new_tokens / max(self.t_total, 1e-9)
        out = {
            "tau": round(self.verified / max(self.passes, 1), 3),
            "acceptance_per_position": [round(a / p, 3) if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.hist.items())},
            "new_tokens": self.new_tokens,
            "verify_passes": self.passes,
            "tokens_per_s": round(tps, 1),
            "time_s": round(self.t_total, 2),
            "time_share": {k: round(v / max(self.t_total, 1e-9), 3) for k, v in
                           (("draft", self.t_draft), ("verify", self.t_verify), ("prefill", self.t_prefill),
                            ("decoder", self.t_total - self.t_draft - self.t_verify - self.t_prefill))},
        }
        if plain is not None:
            out["speedup"] = round(tps / max(plain.new_tokens / max(plain.t_total, 1e-9), 1e-9), 3)
        return out


def build_sets(cfg: Any) -> list[Any]:
    """The prompt sets of an eval-style config (``eval_set`` group), each capped at ``cfg.limit``."""
    sets = []
    for node in (cfg.eval_set or {}).values():
        pset = instantiate(node)
        if cfg.limit and not node.get("limit"):
            pset.limit = cfg.limit
        sets.append(pset)
    if not sets:
        raise UserError("eval_set is empty: choose at least one of mtbench, humaneval, sharegpt, jsonl")
    return sets


def protocol_of(cfg: Any, tokenizer: Any, drafters: dict[str, Any], **extra: Any) -> dict:
    """The evaluation protocol printed with every table (and stored in results.json)."""
    protocol = {"target": str(cfg.target.name_or_path), "template": f"{type(tokenizer).__name__}.chat_template",
                "temperatures": list(cfg.temperatures), "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                "k": cfg.k, "limit": cfg.limit, "drafters": list(drafters), "seed": cfg.seed, **extra}
    print("protocol: " + ", ".join(f"{k}={v}" for k, v in protocol.items()), flush=True)
    return protocol


def encode_prompt(tokenizer: Any, messages: list[dict], chat_template_kwargs: dict | None = None) -> torch.Tensor:
    """A chat's generation prompt as token ids [T]; ``chat_template_kwargs`` go to the template (``enable_thinking``)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **{str(k): v for k, v in dict(chat_template_kwargs or {}).items()})
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


@torch.no_grad()
def evaluate(target: Any, tokenizer: Any, drafters: dict[str, Any], sets: list[Any], temperatures: list[float],
             k: int | str = 5, max_new_tokens: int = 128, top_p: float = 1.0, seed: int = 0, eos_token_ids: list[int] | None = None,
             tie_ulps: float | None = None,
             log=print, prompt_policy: Any = None, journal: "Journal | None" = None,
             chat_template_kwargs: dict | None = None) -> dict:
    """``prompt_policy``: over-long prompts (``eval.sets.PromptLengthPolicy``: truncate from the left, counted).
    ``journal``: each finished prompt's statistics are appended there, and prompts it already holds (an interrupted
    run, ``resume=true``) are read back instead of decoded again. Progress (prompts done, time left) goes to stderr.
    ``chat_template_kwargs``: options of the target's chat template (``{"enable_thinking": False}``)."""
    if k != "auto" and (not isinstance(k, int) or k < 1):
        raise UserError(f"k={k}: the draft length must be an integer >= 1, or auto")
    wanted = {name: getattr(d, "draft_k", k) for name, d in drafters.items()}
    # k=auto (eval.decoding.autok): each drafter learns its acceptance and picks k per round against the measured verify curve
    trees = {name: getattr(d, "tree_spec", None) for name, d in drafters.items()}
    autok = auto_k_factory(target, max_nodes=max([8] + [t.budget for n, t in trees.items() if t and wanted[n] == "auto"])) \
        if "auto" in wanted.values() else None
    for t in temperatures:
        Sampler(float(t), top_p)  # validates
    dec = SpeculativeDecoder(target, eos_token_ids if eos_token_ids is not None else _eos_ids(target, tokenizer))
    target_dtype = next(target.parameters()).dtype
    results: dict = {}
    default_taps = list(target.tap_layers)
    all_convs = []
    for pset in sets:
        convs = pset.conversations()
        if not convs:
            raise UserError(f"prompt set {pset.name}: no prompts")
        all_convs.append(convs)
    done = journal.read() if journal is not None else {}
    total = sum(len(c) for c in all_convs) * len(temperatures)
    progress = Progress(total, "eval", unit="prompts", initial=len(done))
    if done:
        log(f"resume: {len(done)} of {total} prompts already evaluated ({journal.path}); decoding the rest")
    for pset, convs in zip(sets, all_convs):
        for temp in temperatures:
            temp = float(temp)
            aggs = {name: Agg() for name in ["plain", *drafters]}
            ks = {name: (autok(trees[name]) if w == "auto" else w) for name, w in wanted.items()}  # AutoK learns per drafter and temperature
            for ci, conv in enumerate(convs):
                key = (pset.name, f"T={temp:g}", ci)
                if key in done:  # finished before an interruption: its sums, not a new decode
                    for name, d in done[key]["aggs"].items():
                        aggs[name].merge(Agg.from_dict(d))
                    for name, chosen in done[key].get("auto_k", {}).items():
                        ks[name].chosen += chosen
                    continue
                before = {name: Agg() for name in aggs}
                for name in aggs:
                    before[name].merge(aggs[name])
                n_chosen = {name: len(ks[name].chosen) for name in ks if hasattr(ks[name], "chosen")}
                # every drafter answers turn i+1 after plain decoding's answers to turns 0..i: the same prompt for all,
                # so a greedy divergence in turn i+1 is compared on the context it came from (in bf16 a numerical tie
                # in turn i would otherwise give a drafter another prompt than plain decoding's in turn i+1)
                history = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
                for ti, turn in enumerate(conv["turns"]):
                    plain_out, plain_top = None, []
                    msgs = history + [{"role": "user", "content": turn}]
                    prompt = encode_prompt(tokenizer, msgs, chat_template_kwargs)
                    if prompt_policy is not None:
                        prompt = prompt_policy(prompt, (pset.name, ci, ti))
                    for name in aggs:
                        drafter = NoDrafter() if name == "plain" else drafters[name]
                        target.set_tap_layers(getattr(drafter, "tap_layers", default_taps))
                        ids = prompt
                        g = torch.Generator().manual_seed(hash((seed, ci, ti)) % (2**31))
                        out, st = dec.generate(ids, drafter, k=0 if name == "plain" else ks[name], max_new_tokens=max_new_tokens,
                                               sampler=Sampler(temp, top_p, generator=g), record_top=4 if name == "plain" else 0,
                                               tree=getattr(drafter, "tree_spec", None))
                        aggs[name].add(st)
                        if name == "plain":
                            plain_out, plain_top = out, st.top
                        elif temp == 0:
                            v = classify(plain_out, out, plain_top, target_dtype, tie_ulps)
                            aggs[name].identical += v.kind == "identical"
                            aggs[name].ties += v.kind == "tie"
                            aggs[name].defects += v.kind == "defect"
                            if v.kind != "identical":
                                aggs[name].divergences.append({"prompt": ci, "turn": ti, **v.as_dict()})
                    answer = tokenizer.decode(plain_out, skip_special_tokens=True).strip()
                    history = msgs + [{"role": "assistant", "content": answer}]
                if journal is not None:
                    journal.add(key, {name: _delta(aggs[name], before[name]).as_dict() for name in aggs},
                                {name: ks[name].chosen[n:] for name, n in n_chosen.items()})
                progress.update(1, note=f"{pset.name} T={temp:g} " + " ".join(
                    f"{n}:τ={a.verified / max(a.passes, 1):.2f}" for n, a in aggs.items() if n != "plain"))
            row = {}
            for name, a in aggs.items():
                row[name] = a.summary(None if name == "plain" else aggs["plain"])
                if name != "plain" and hasattr(ks[name], "chosen"):
                    chosen = ks[name].chosen
                    row[name]["auto_k"] = {"mean": round(sum(chosen) / max(len(chosen), 1), 2),
                                           "histogram": {str(v): chosen.count(v) for v in sorted(set(chosen))},
                                           "verify_curve": [round(v, 3) for v in ks[name].curve]}  # as learnt by the end
                if name != "plain" and temp == 0:
                    row[name]["greedy_identical"] = f"{a.identical}/{a.generations}"
                    row[name]["numerical_ties"] = a.ties
                    row[name]["defects"] = a.defects
                    row[name]["divergences"] = a.divergences
            results.setdefault(pset.name, {})[f"T={temp:g}"] = row
    progress.close()
    target.set_tap_layers(default_taps)
    return results


def _delta(after: Agg, before: Agg) -> Agg:
    """What one prompt added to a drafter's sums (``after`` − ``before``), for the journal."""
    d = Agg()
    for f in ("new_tokens", "passes", "verified", "drafted", "t_draft", "t_verify", "t_prefill", "t_total",
              "generations", "identical", "ties", "defects"):
        setattr(d, f, getattr(after, f) - getattr(before, f))
    d.hist = {a: c - before.hist.get(a, 0) for a, c in after.hist.items() if c - before.hist.get(a, 0)}
    d.proposed_at = [p - (before.proposed_at[i] if i < len(before.proposed_at) else 0) for i, p in enumerate(after.proposed_at)]
    d.accepted_at = [a - (before.accepted_at[i] if i < len(before.accepted_at) else 0) for i, a in enumerate(after.accepted_at)]
    d.divergences = after.divergences[len(before.divergences):]
    return d


class Journal:
    """``journal.jsonl`` in the output folder: a header with the protocol, then one line per finished prompt (its
    statistics for every drafter). A rerun with ``resume=true`` into the same folder reads it back and decodes only the
    prompts it lacks; a different protocol (drafters, sets, temperatures, k, lengths, seed, target) is refused. A line
    cut off by the interruption is ignored. Nothing is written before the first prompt is finished, so a run that
    fails on its input leaves the folder as it was. The adaptive k of ``k=auto`` starts learning afresh on resume."""

    def __init__(self, path: str | Path, protocol: dict, resume: bool, overwrite: bool = False):
        self.path, self.protocol = Path(path), json.loads(json.dumps(protocol, default=str))
        self.resume = resume and self.path.exists()
        if self.path.exists() and not resume and not overwrite:
            raise UserError(f"{self.path.parent}: holds an evaluation already; resume=true continues it, "
                            "overwrite=true starts it again, or choose another out_dir")
        self.started = self.resume  # else the first finished prompt starts a new journal over any old one

    def read(self) -> dict:
        if not self.resume:
            return {}
        lines = self.path.read_text(encoding="utf-8").split("\n")
        try:
            head = json.loads(lines[0])["protocol"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{self.path}: not an evaluation journal (delete it to start over)") from None
        if head != self.protocol:
            diff = sorted(k for k in set(head) | set(self.protocol) if head.get(k) != self.protocol.get(k))
            raise UserError(f"{self.path}: was written with another protocol ({', '.join(diff)} differ); evaluate "
                            "into another out_dir, or rerun with the journal's settings")
        done = {}
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                done[tuple(rec["key"])] = rec
            except (ValueError, KeyError, TypeError):
                continue  # empty, or cut off by the interruption
        return done

    def add(self, key: tuple, aggs: dict, auto_k: dict) -> None:
        if not self.started:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"protocol": self.protocol}) + "\n")
            self.started = True
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": list(key), "aggs": aggs, "auto_k": auto_k}) + "\n")
            f.flush()


def _eos_ids(target: Any, tokenizer: Any) -> list[int]:
    ids = set()
    gen = getattr(target.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), target.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)


def markdown_table(results: dict, protocol: dict) -> str:
    """One row per (set, temperature, drafter)."""
    k = protocol["k"]
    cols = max([k if isinstance(k, int) else 0] + [len(r["acceptance_per_position"]) for by_t in results.values()
                                                    for by_d in by_t.values() for r in by_d.values()])  # trees, per-drafter k
    head = ["set", "T", "drafter", "τ", *[f"acc@{i + 1}" for i in range(cols)], "tok/s", "speed-up", "draft", "verify", "decoder", "greedy = plain"]
    lines = [f"Protocol: template `{protocol['template']}`, max_new_tokens={protocol['max_new_tokens']}, k={k}, "
             f"top_p={protocol['top_p']}, prompts per set ≤ {protocol['limit']}, target `{protocol['target']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sname, by_t in results.items():
        for tname, by_d in by_t.items():
            for dname, r in by_d.items():
                acc = (r["acceptance_per_position"] + [None] * cols)[:cols]
                ts = r["time_share"]
                lines.append("| " + " | ".join([sname, tname[2:], dname, f"{r['tau']:.2f}",
                                                 *["" if a is None else f"{a:.2f}" for a in acc],
                                                 f"{r['tokens_per_s']:.0f}", f"{r.get('speedup', 1.0):.2f}×",
                                                 f"{ts['draft']:.0%}", f"{ts['verify']:.0%}", f"{ts['decoder']:.0%}",
                                                 greedy_cell(r)]) + " |")
    return "\n".join(lines) + "\n"


def greedy_cell(r: dict) -> str:
    """``4/6 identical, 2 ties, 0 defects`` (empty for sampled rows)."""
    if not r.get("greedy_identical"):
        return ""
    return f"{r['greedy_identical']} identical, {r.get('numerical_ties', 0)} ties, {r.get('defects', 0)} defects"


def count_defects(results: dict) -> int:
    return sum(r.get("defects", 0) for by_t in results.values() for by_d in by_t.values() for r in by_d.values())


def plot_acceptance(results: dict, path: Path) -> None:
    """Per-position conditional acceptance per set (T=0 solid, T>0 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(results)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    for ax, sname in zip(axes[0], sets):
        for ti, (tname, by_d) in enumerate(results[sname].items()):
            for di, (dname, r) in enumerate(by_d.items()):
                acc = [a for a in r["acceptance_per_position"] if a is not None]
                if dname == "plain" or not acc:
                    continue
                ax.plot(range(1, len(acc) + 1), acc, marker="o", linestyle="-" if ti == 0 else "--", color=f"C{di}",
                        label=f"{dname} {tname} (τ={r['tau']:.2f})")
        ax.set_title(sname)
        ax.set_xlabel("draft position")
        ax.set_ylabel("conditional acceptance")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_report(results: dict, protocol: dict, out_dir: Path) -> str:
    from data.errors import atomic_file

    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, protocol)
    with atomic_file(out_dir / "results.json") as f:
        json.dump({"protocol": protocol, "results": results}, f, indent=2)
    with atomic_file(out_dir / "results.md") as f:
        f.write(table)
    plot_acceptance(results, out_dir / "acceptance.png")
    return table


def metrics_of(results: dict) -> dict[str, float]:
    """The evaluation's figures as flat metric names (``mtbench/T=0/eagle3/tau``, ``.../speedup``, ``.../acc_1``)."""
    out: dict[str, float] = {}
    for sname, by_t in results.items():
        for tname, by_d in by_t.items():
            for dname, r in by_d.items():
                base = f"{sname}/{tname}/{dname}"
                out[f"{base}/tau"] = r["tau"]
                out[f"{base}/tokens_per_s"] = r["tokens_per_s"]
                if "speedup" in r:
                    out[f"{base}/speedup"] = r["speedup"]
                for j, a in enumerate(r["acceptance_per_position"]):
                    if a is not None:
                        out[f"{base}/acc_{j + 1}"] = a
    return out


def log_results(node: Any, results: dict, protocol: dict) -> None:
    """Send the figures and the protocol to the configured logger (``logger=csv|tensorboard|wandb``, as training
    does; ``~logger``: the files alone)."""
    if not node:
        return
    logger = instantiate(node)
    logger.log_hyperparams({k: v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
                            for k, v in protocol.items()})
    logger.log_metrics(metrics_of(results), step=0)
    logger.finalize("success")
