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
        for i, (p, a) in enumerate(zip(st.proposed_at, st.accepted_at)):
            while len(self.proposed_at) <= i:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += p
            self.accepted_at[i] += a
        self.t_draft += st.t_draft
        self.t_verify += st.t_verify
        self.t_prefill += st.t_prefill
        self.t_total += st.t_total
        self.generations += 1

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
             log=print, prompt_policy: Any = None, chat_template_kwargs: dict | None = None) -> dict:
    """``prompt_policy``: over-long prompts (``eval.sets.PromptLengthPolicy``: truncate from the left, counted);
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
    for pset in sets:
        convs = pset.conversations()
        if not convs:
            raise UserError(f"prompt set {pset.name}: no prompts")
        for temp in temperatures:
            temp = float(temp)
            aggs = {name: Agg() for name in ["plain", *drafters]}
            ks = {name: (autok(trees[name]) if w == "auto" else w) for name, w in wanted.items()}  # AutoK learns per drafter and temperature
            for ci, conv in enumerate(convs):
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
                if (ci + 1) % 10 == 0 or ci + 1 == len(convs):
                    log(f"  [{pset.name} T={temp:g}] {ci + 1}/{len(convs)} " + " ".join(
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
    target.set_tap_layers(default_taps)
    return results


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
