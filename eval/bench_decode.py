"""``python -m eval.bench_decode``: where the time of speculative decoding goes, per drafter, beside plain decoding.

    python -m eval.bench_decode target=smollm2                             # n-gram + the shipped SmolLM2 head
    python -m eval.bench_decode target=smollm2 target.fast_linear=false    # the same without models/cpu_linear.py
    python -m eval.bench_decode target=smollm2 'tree={budget:16,depth:6,topk:4}' temperatures=[0,1]

On the first user turn of ``limit`` prompts of the eval set, plain decoding (:class:`eval.decoding.decoder.NoDrafter`) and
then each drafter generate up to ``max_new_tokens`` tokens with :class:`eval.decoding.decoder.SpeculativeDecoder`
(interleaved per prompt, the same sampler seed for all). From the decoder's own clocks (``GenStats``), per drafter:

- T(1): plain decoding's seconds per verify pass (one token over the KV cache, lm_head included);
- draft cost: draft seconds (``propose`` + ``commit``) per drafted token, as a fraction of T(1);
- verify cost T(n)/T(1): the drafter's seconds per verify pass over T(1), at its mean verified block size
  n = drafted/passes + 1 (the pending token plus the drafted tokens or tree nodes);
- the decoder's own share of wall time (acceptance, cache crops, bookkeeping): 1 − (draft + verify + prefill)/total;
- τ, the realised speed-up (tokens/s against plain decoding's on the same prompts), the free-draft bound
  τ·T(1)/T(n) (the speed-up if drafting cost nothing) and realised/bound;
- what drafting alone leaves of the bound, r/(r + d·c) with r = T(n)/T(1), d drafted tokens per pass and c the
  draft cost per token (realised/bound is this less the decoder's and prefill's share), and the draft cost
  r/(4·d) at which realised/bound would reach 0.8.

Beside them: T(1+D)/T(1) measured in isolation by :func:`eval.decoding.autok.verify_costs` over a cache of
``profile.context`` tokens, for D up to the largest block used; and ``torch.profiler`` tables (the top operators
by self CPU time: calls, self ms per call) of one plain target step, one verify step of each block size used (a
causal block: a tree's attention mask is not reproduced) and one ``propose`` (``propose_tree`` with ``tree``) of
each drafter in the state of decoding (after a round that accepted ``profile.after_round`` tokens), per call (the
mean of ``profile.repeat`` profiled calls). Writes ``bench_decode.json`` into the run directory and prints a
table. The JSON records ``target.fast_linear`` (:mod:`models.cpu_linear`) and how many linear layers it packed,
so a before/after pair is two runs.
"""
from __future__ import annotations

import platform
import time

from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.errors import UserError, cli, instantiate, run_main, write_json
from eval.decoding.kvcache import new_cache
from eval.run import Agg

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_HEADS = {"smollm2": "assets/smollm2-eagle3"}  # target name -> the head ``path: auto`` means


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def metrics(s: Agg, plain: Agg) -> dict:
    """The time split of one drafter against plain decoding's (see the module docstring)."""
    t1 = plain.t_verify / max(plain.passes, 1)
    per_pass = s.t_verify / max(s.passes, 1)
    ratio = per_pass / t1 if t1 > 0 else None
    tau = s.verified / max(s.passes, 1)
    tps = s.new_tokens / max(s.t_total, 1e-9)
    plain_tps = plain.new_tokens / max(plain.t_total, 1e-9)
    speedup = tps / max(plain_tps, 1e-9)
    bound = tau / ratio if ratio else None
    total = max(s.t_total, 1e-9)
    d = s.drafted / max(s.passes, 1)  # drafted tokens per verify pass
    c = s.t_draft / s.drafted / t1 if s.drafted and t1 > 0 else None
    return {
        "tau": _r(tau, 3),
        "mean_block": _r(s.drafted / max(s.passes, 1) + 1, 3),
        "verify_ms_per_pass": _r(per_pass * 1e3, 3),
        "verify_cost_ratio": _r(ratio, 3),
        "draft_ms_per_pass": _r(s.t_draft / max(s.passes, 1) * 1e3, 3),
        "draft_cost_per_token": _r(s.t_draft / s.drafted / t1, 4) if s.drafted and t1 > 0 else None,
        "decoder_share": _r(max(0.0, s.t_total - s.t_draft - s.t_verify - s.t_prefill) / total, 4),
        "time_share": {"draft": _r(s.t_draft / total), "verify": _r(s.t_verify / total), "prefill": _r(s.t_prefill / total)},
        "tokens_per_s": _r(tps, 2),
        "speedup": _r(speedup, 3),
        "free_draft_bound": _r(bound, 3),
        "realised_over_bound": _r(speedup / bound, 3) if bound else None,
        # a round costs T(n) + d·c·T(1) against the bound's T(n): what drafting alone leaves of the bound, and the draft
        # cost per token at which realised/bound would reach 0.8 at this block size (r / (4·d))
        "bound_left_by_draft": _r(ratio / (ratio + d * c), 3) if ratio and c is not None else None,
        "draft_cost_for_80pct": _r(ratio / (4 * d), 4) if ratio and d > 0 else None,
        "new_tokens": s.new_tokens,
        "passes": s.passes,
        "drafted": s.drafted,
        "generations": s.generations,
    }


def profile_call(fn: Callable[[], Any], reset: Callable[[], Any], top: int, repeat: int = 1) -> dict:
    """``torch.profiler`` over ``repeat`` calls of ``fn()`` after one warm-up call (``reset()`` before each): the
    ``top`` operators by self CPU time, with calls and times per ``fn()`` call (the mean of the ``repeat``)."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    fn()
    wall, count, self_us = 0.0, {}, {}
    for _ in range(repeat):  # one profiler session per call: reset() stays out of the tables
        reset()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            fn()
            wall += time.perf_counter() - t
        for e in prof.key_averages():
            count[e.key] = count.get(e.key, 0) + e.count
            self_us[e.key] = self_us.get(e.key, 0.0) + e.self_cpu_time_total
    reset()
    total = sum(self_us.values())
    keys = sorted(self_us, key=lambda key: -self_us[key])[:top]
    return {"repeat": repeat, "wall_ms_profiled": _r(wall / repeat * 1e3, 3), "self_cpu_ms": _r(total / repeat / 1e3, 3),
            "ops": [{"name": key, "calls": _r(count[key] / repeat, 2), "self_ms_per_call": _r(self_us[key] / max(count[key], 1) / 1e3, 4),
                     "share": _r(self_us[key] / max(total, 1e-9), 3)} for key in keys]}


@torch.no_grad()
def profile_target_steps(target: Any, sizes: list[int], context: int, top: int, repeat: int = 1) -> dict:
    """One decoder step of the target (forward over a cache of ``context`` random tokens, then lm_head on every
    row) for each block size in ``sizes``; size 1 is plain decoding's step."""
    from eval.decoding.decoder import crop

    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    cache = new_cache()
    target(torch.randint(0, V, (1, context), generator=g), cache=cache, use_cache=True)
    out = {}
    for n in sizes:
        block = torch.randint(0, V, (1, n), generator=g)

        def step(block=block):
            o = target(block, cache=cache, use_cache=True)
            target.model.lm_head(o.last_state)

        out[str(n)] = {"tokens": n, "context": context, **profile_call(step, lambda: crop(cache, context), top, repeat)}
    return out


@torch.no_grad()
def profile_propose(target: Any, drafter: Any, ids: torch.Tensor, k: int, tree: Any, top: int, repeat: int = 1,
                    after_round: int = 0) -> dict:
    """One ``propose`` (``propose_tree`` when ``tree`` and the drafter has it). ``after_round`` = m > 0: in the
    state of decoding, not of a fresh prompt: ``start`` on the prompt less its last m + 1 tokens, one round
    (``propose``, then ``commit`` of the next m prompt tokens, as if m had been accepted), then the profiled call with
    the last prompt token pending; so a head that catches up on the prompt in its first ``propose`` (MTP's depths,
    EAGLE-3's context) is profiled at a round's cost. m = 0: right after ``start`` on the whole prompt."""
    from eval.decoding.decoder import Sampler, target_rows

    ids = ids.view(1, -1)
    T = ids.shape[1]
    m = max(0, min(int(after_round), T - 2))  # a one-token prompt: no round before (m = 0)
    out = target(ids, cache=new_cache(), use_cache=True)
    as_tree = tree is not None and hasattr(drafter, "propose_tree")

    def propose(pending: int):
        return drafter.propose_tree(pending, tree, Sampler()) if as_tree else drafter.propose(pending, k, Sampler())

    if m == 0:
        pending = int(target.model.lm_head(out.last_state[:, -1:])[0, -1].argmax())
        reset = lambda: drafter.start(ids, out)  # noqa: E731
    else:
        s, pending = T - m - 1, int(ids[0, -1])

        def reset():
            drafter.start(ids[:, :s], target_rows(out, list(range(s))))
            propose(int(ids[0, s]))
            drafter.commit(ids[0, s: s + m], target_rows(out, list(range(s, s + m))))

    res = profile_call(lambda: propose(pending), reset, top, repeat)
    return {"call": "propose_tree" if as_tree else "propose", "prompt_tokens": T, "after_round": m, **res}


def tree_spec(node: Any) -> Any:
    """``tree`` of the config → a TreeSpec (None for null); bad keys or numbers are one UserError line."""
    from models.heads.trees import TreeSpec

    if node is None:
        return None
    d = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    if not isinstance(d, dict):
        raise UserError(f"tree={d!r}: give null or {{budget: 16, depth: 6, topk: 4, min_prob: 0.0}}")
    unknown = set(d) - {"budget", "depth", "topk", "min_prob"}
    if unknown:
        raise UserError(f"tree: unknown key(s) {sorted(unknown)} (budget, depth, topk, min_prob)")
    try:
        return TreeSpec(**{k: (float(v) if k == "min_prob" else int(v)) for k, v in d.items()})
    except (TypeError, ValueError):
        raise UserError(f"tree={d}: budget, depth, topk must be integers >= 1 and min_prob a number in [0, 1)") from None


def drafter_nodes(cfg: DictConfig) -> dict[str, Any]:
    """The drafter configs to build: ``path: auto`` resolved (or the drafter skipped), ``path: null`` skipped, and
    every other path checked to exist (before minutes of target loading)."""
    nodes = {}
    for name, node in (cfg.drafters or {}).items():
        if node is None:
            continue
        if "path" in node:
            path = node.path
            if path == "auto":
                path = SHIPPED_HEADS.get(str(cfg.target.name_or_path))
                if path is None:
                    print(f"note: drafters.{name}.path=auto: no shipped head for target {cfg.target.name_or_path}; skipped")
                    continue
                path = str(ROOT / path)
            if path is None:
                print(f"note: drafters.{name}.path=null; skipped")
                continue
            if not Path(str(path)).exists():
                raise UserError(f"drafters.{name}.path={path}: no such directory")
            node = OmegaConf.merge(node, {"path": str(path)})
        nodes[str(name)] = node
    return nodes


def check_config(cfg: DictConfig) -> Any:
    """Every cheap check before the target loads; returns the TreeSpec (or None)."""
    from eval.decoding.decoder import Sampler

    if not isinstance(cfg.k, int) or cfg.k < 1:
        raise UserError(f"k={cfg.k}: the chain length must be an integer >= 1")
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 2:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens}: must be an integer >= 2 (one verify pass at least)")
    if not cfg.temperatures:
        raise UserError("temperatures is empty: give e.g. [0.0] or [0.0, 1.0]")
    for t in cfg.temperatures:
        Sampler(float(t), cfg.top_p)  # validates
    if min(int(cfg.profile.context), int(cfg.profile.top), int(cfg.profile.repeat)) < 1:
        raise UserError(f"profile.context={cfg.profile.context}, profile.top={cfg.profile.top}, "
                        f"profile.repeat={cfg.profile.repeat}: each must be >= 1")
    after = cfg.profile.get("after_round", 0)
    if not isinstance(after, int) or after < 0:
        raise UserError(f"profile.after_round={after}: the tokens the round before the profiled propose accepted, "
                        f"an integer >= 0 (0: right after start)")
    if int(cfg.isolated_reps) < 0:
        raise UserError(f"isolated_reps={cfg.isolated_reps}: must be >= 0 (0 skips the isolated measurement)")
    return tree_spec(cfg.tree)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@torch.no_grad()
def bench(cfg: DictConfig) -> dict:
    """Run the benchmark of ``cfg`` (conf/bench_decode.yaml), write ``bench_decode.json`` into ``cfg.out_dir`` and
    print the table; returns what was written."""
    from eval.decoding.decoder import NoDrafter, Sampler, SpeculativeDecoder
    from eval.decoding.autok import verify_costs
    from eval.decoding.drafters import build_drafter
    from eval.run import _eos_ids, build_sets, encode_prompt
    from eval.sets import PromptLengthPolicy
    from models.target import load_tokenizer

    tree = check_config(cfg)
    nodes = drafter_nodes(cfg)
    sets = build_sets(cfg)
    target = instantiate(cfg.target)
    tok = load_tokenizer(cfg.target.name_or_path)
    default_taps = list(target.tap_layers)
    drafters = {name: build_drafter(node, target) for name, node in nodes.items()}
    target.set_tap_layers(default_taps)
    k, max_new = int(cfg.k), int(cfg.max_new_tokens)
    block_max = max(k, tree.budget if tree is not None and any(hasattr(d, "propose_tree") for d in drafters.values()) else 0)
    max_pos = getattr(target.config, "max_position_embeddings", None)
    policy = PromptLengthPolicy(cfg.get("max_prompt_tokens"), max_pos, max_new, block_max)

    prompts: list[tuple[str, torch.Tensor]] = []
    for pset in sets:
        convs = pset.conversations()
        if not convs:
            raise UserError(f"prompt set {pset.name}: no prompts")
        for ci, conv in enumerate(convs):
            msgs = ([{"role": "system", "content": conv["system"]}] if conv.get("system") else []) + [
                {"role": "user", "content": conv["turns"][0]}]
            prompts.append((f"{pset.name}/{conv.get('id', ci)}", policy(encode_prompt(tok, msgs), (pset.name, ci, 0))))

    dec = SpeculativeDecoder(target, _eos_ids(target, tok))
    names = ["plain", *drafters]

    def gen(name: str, ids: torch.Tensor, temp: float, seed: int, n: int):
        drafter = NoDrafter() if name == "plain" else drafters[name]
        target.set_tap_layers(getattr(drafter, "tap_layers", default_taps))
        g = torch.Generator().manual_seed(seed)
        return dec.generate(ids, drafter, k=0 if name == "plain" else k, max_new_tokens=n,
                            sampler=Sampler(temp, cfg.top_p, generator=g), tree=None if name == "plain" else tree)

    if cfg.warmup:  # unrecorded: lazy initialisation and kernel choice would otherwise be charged to the first run
        for name in names:
            gen(name, prompts[0][1], 0.0, 0, min(8, max_new))

    results: dict = {}
    for temp in (float(t) for t in cfg.temperatures):
        sums = {name: Agg() for name in names}
        for pi, (pname, ids) in enumerate(prompts):
            plain_out = None
            for name in names:
                out, st = gen(name, ids, temp, int(cfg.seed) * 100003 + pi, max_new)
                sums[name].add(st)
                if name == "plain":
                    plain_out = out
                else:
                    sums[name].identical += out == plain_out
            print(f"  [T={temp:g}] {pi + 1}/{len(prompts)} " + " ".join(
                f"{n}:τ={s.verified / max(s.passes, 1):.2f}" for n, s in sums.items() if n != "plain"), flush=True)
        row = {"t1_ms": _r(sums["plain"].t_verify / max(sums["plain"].passes, 1) * 1e3, 3)}
        for name in names:
            m = metrics(sums[name], sums["plain"])
            if name != "plain":
                m["tree"] = tree is not None and hasattr(drafters[name], "propose_tree")
                if temp == 0:
                    m["greedy_identical"] = f"{sums[name].identical}/{sums[name].generations}"
            row[name] = m
        results[f"T={temp:g}"] = row
    target.set_tap_layers(default_taps)

    # isolated verify costs and profiles, at the block sizes the drafters used
    sizes = sorted({1, *(max(1, round(r[n]["mean_block"])) for r in results.values() for n in drafters)})
    context = int(cfg.profile.context)
    if max_pos:
        context = max(1, min(context, int(max_pos) - max(sizes) - 1))
    isolated = None
    if int(cfg.isolated_reps) > 0:
        costs = verify_costs(target.model, max(sizes) - 1, context, int(cfg.isolated_reps), "cpu")
        isolated = {"context": context, "reps": int(cfg.isolated_reps), "t_ms": [_r(c * 1e3, 3) for c in costs],
                    "ratio": [_r(c / costs[0], 3) for c in costs]}
        for r in results.values():
            for n in drafters:
                r[n]["isolated_verify_cost_ratio"] = isolated["ratio"][max(1, round(r[n]["mean_block"])) - 1]
    top, repeat = int(cfg.profile.top), int(cfg.profile.repeat)
    profiles = {"target": profile_target_steps(target, sizes, context, top, repeat), "propose": {}}
    for name, drafter in drafters.items():
        target.set_tap_layers(getattr(drafter, "tap_layers", default_taps))
        profiles["propose"][name] = profile_propose(target, drafter, prompts[0][1], k, tree, top, repeat,
                                                    int(cfg.profile.get("after_round", 0)))
    target.set_tap_layers(default_taps)

    protocol = {
        "target": str(cfg.target.name_or_path), "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "fast_linear": cfg.target.get("fast_linear"), "packed_linears": getattr(target, "packed_linears", None),
        "linear_plans": {shape: [list(step) for step in plan]
                         for shape, plan in getattr(target, "linear_kernels", {}).get("plans", {}).items()},
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "sets": [s.name for s in sets], "prompts": len(prompts), "turn": "first user turn",
        "max_new_tokens": max_new, "k": k, "tree": None if tree is None else vars(tree),
        "temperatures": [float(t) for t in cfg.temperatures], "top_p": cfg.top_p, "seed": cfg.seed,
        "warmup": bool(cfg.warmup), "drafters": {n: OmegaConf.to_container(nodes[n], resolve=True) for n in drafters},
        "truncated_prompts": policy.counts(),
    }
    result = {"protocol": protocol, "results": results, "isolated": isolated, "profiles": profiles}
    out = Path(cfg.out_dir) / "bench_decode.json"
    write_json(out, result)
    print(table(result))
    print(f"wrote {out}")
    return result


def table(result: dict) -> str:
    """The short printed summary: one row per (temperature, drafter), then the profiles' totals and top operator."""
    p = result["protocol"]
    lines = [f"target {p['target']} ({p['dtype']}, fast_linear={p['fast_linear']}, {p['packed_linears']} linears given other kernels), "
             f"{p['threads']} threads; {p['prompts']} prompts of {','.join(p['sets'])}, {p['max_new_tokens']} new tokens, "
             f"k={p['k']}" + (f", tree={p['tree']}" if p["tree"] else ""), ""]
    head = ["T", "drafter", "T(1) ms", "τ", "n", "T(n)/T(1)", "isolated", "draft/tok", "decoder", "tok/s", "speed-up",
            "bound", "real/bound"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
    for tname, row in result["results"].items():
        for name, m in row.items():
            if name == "t1_ms":
                continue
            lines.append("| " + " | ".join([
                tname[2:], name, f(row["t1_ms"], ".1f") if name == "plain" else "", f(m["tau"], ".2f"), f(m["mean_block"], ".2f"),
                f(m["verify_cost_ratio"], ".2f"), f(m.get("isolated_verify_cost_ratio"), ".2f"),
                f(m["draft_cost_per_token"], ".3f"), f(m["decoder_share"], ".1%"), f(m["tokens_per_s"], ".1f"),
                f(m["speedup"], ".2f") + "×", f(m["free_draft_bound"], ".2f") + "×", f(m["realised_over_bound"], ".2f")]) + " |")
    lines.append("")
    prof = result["profiles"]
    for kind, entries in (("target step", prof["target"]), ("propose", prof["propose"])):
        for key, e in entries.items():
            op = e["ops"][0] if e["ops"] else None
            what = (f"{key} token(s) over {e['context']}" if kind == "target step"
                    else f"{key} ({e['call']} after a round of {e.get('after_round', 0)})")
            lines.append(f"profile {kind} {what}: {e['self_cpu_ms']:.2f} ms self CPU"
                         + (f"; top {op['name']} {op['share']:.0%} ({op['calls']:g} calls)" if op else ""))
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="bench_decode", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    bench(cfg)


if __name__ == "__main__":
    run_main(main)
