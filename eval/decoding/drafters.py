"""Drafters for the decoder, built from config: trained heads (exported by ``python -m train``), a head with prompt
lookup, an independent draft model, and the ``k=auto`` policy factory. Every config entry of ``drafters:`` in
``python -m eval`` and its siblings goes through :func:`build_drafter`."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from data.errors import UserError, instantiate, shipped


def build_drafter(node: Any, target: Any, name: str = "drafter") -> Any:
    """Instantiate a drafter config; factories that take ``target`` get it (trained heads need their target).
    A ``tree:`` key (budget, depth, topk, min_prob: :class:`models.heads.trees.TreeSpec`) makes the drafter
    propose trees (``drafter.tree_spec``), a ``k:`` key (an integer or auto) overrides the run's k for it; the same
    head can be listed several times (chain, tree, k=auto) and is then compared side by side."""
    from omegaconf import OmegaConf

    from models.heads.trees import TreeSpec

    node = OmegaConf.create(OmegaConf.to_container(node) if OmegaConf.is_config(node) else dict(node))
    tree = node.pop("tree", None) if "tree" in node else None
    k = node.pop("k", None) if "k" in node else None
    part = instantiate(node, _partial_=True)
    fn = part.func if hasattr(part, "func") else part
    takes_target = "target" in inspect.signature(fn).parameters
    extra = {"target": target} if takes_target else {}
    try:  # an unknown or missing key is the config's mistake: one line, not a traceback from the call
        inspect.signature(fn).bind(*part.args, **part.keywords, **extra)
    except TypeError as e:
        raise UserError(f"drafters.{name} ({node.get('_target_')}): {e}") from None
    drafter = part(**extra)
    if tree is not None:
        if not hasattr(drafter, "propose_tree"):
            raise UserError(f"drafters.{name}.tree: {type(drafter).__name__} drafts chains only (remove tree:)")
        try:
            drafter.tree_spec = TreeSpec(**OmegaConf.to_container(tree))
        except TypeError as e:
            raise UserError(f"drafters.{name}.tree: {e} (keys: budget, depth, topk, min_prob)") from None
    if k is not None:
        if k != "auto" and (not isinstance(k, int) or k < 1):
            raise UserError(f"drafters.{name}.k={k}: an integer >= 1, or auto")
        drafter.draft_k = k
    return drafter


def load_head(path: str, target: Any, linear_dtype: str = "auto", decode: dict | None = None) -> Any:
    """A trained draft head exported by ``python -m train`` (``run_dir/draft``). Where the target's linear layers
    take CPU kernels chosen for speed (``target.fast_linear``), so do the head's (:mod:`models.cpu_linear`): a tree
    level or a block drafts several rows at once, where MKL's product can cost 2–3× one row. ``linear_dtype``:
    ``auto`` (default) times each layer here at 1, 2, 4 and 8 rows and gives each row count the fastest of MKL,
    MKL on a transposed copy, fp32 and bf16 packing (:func:`models.cpu_linear.pack_fastest`); ``float32`` packs
    every layer in fp32, ``bfloat16`` in bf16 (half the
    bytes a drafted token reads; CPUs with bf16 instructions). Measure with ``eval.bench_decode``; the draft's
    logits change in their last bits, the output does not. ``decode``: settings that only change how the head drafts
    (its class's ``decode_settings``, such as MTP's ``reuse_last_module``), replacing the exported ones."""
    from models.cpu_linear import pack_fastest, pack_linears
    from models.formats import load_draft
    from models.target import DTYPES

    if linear_dtype not in ("float32", "bfloat16", "auto"):
        raise UserError(f"linear_dtype={linear_dtype}: float32, bfloat16 or auto")
    head = load_draft(path, target).eval()
    head.answer_temperature = trained_temperature(path)
    for key, value in (decode or {}).items():
        if key not in head.decode_settings:
            raise UserError(f"decode.{key}: not a decoding setting of {type(head).__name__} "
                            f"(it has: {', '.join(head.decode_settings) or 'none'})")
        old = getattr(head, key)
        try:
            if isinstance(old, bool) and not isinstance(value, bool):  # bool("false") is True
                raise TypeError
            setattr(head, key, type(old)(value))
        except (TypeError, ValueError):
            raise UserError(f"decode.{key}={value!r}: expected a {type(old).__name__}") from None
        head.init_args[key] = getattr(head, key)
    if getattr(target, "fast_linear", False):
        if linear_dtype == "auto":
            pack_fastest(head)
        else:
            pack_linears(head, DTYPES[linear_dtype])
    return head


def trained_temperature(path: str) -> float | None:
    """The temperature of the answers a draft folder's head was trained on (its ``train_config.json``), if known."""
    from data.errors import read_json
    from data.regenerate import answer_temperature

    tc = Path(shipped(path)) / "train_config.json"
    try:
        return answer_temperature((read_json(tc) or {}).get("data")) if tc.is_file() else None
    except UserError:
        return None  # unreadable: the head still loads; nothing to warn about


def temperature_notes(drafters: dict[str, Any], temperatures: list[float]) -> list[str]:
    """One note per head evaluated at a temperature other than the one its training answers were sampled at: a head
    trained on greedy answers meets sampled text at T>0 (on the embedded target 15 minutes of DFlash, DSpark or the
    floor on greedy answers drafted 1.3–1.9× further at T=0 and 0.73–0.83× as far at T=1: conf/data/embedded_regen.yaml)."""
    notes = []
    for name, d in drafters.items():
        t_data = getattr(getattr(d, "head", d), "answer_temperature", None)
        other = [t for t in temperatures if t_data is not None and abs(float(t) - t_data) > 1e-6]
        if other:
            notes.append(f"note: drafters.{name} was trained on answers sampled at T={t_data:g}; at T="
                         f"{', '.join(f'{t:g}' for t in other)} it drafts for text its data did not cover")
    return notes


def load_head_with_lookup(path: str, target: Any, lookup_k: int = 8, max_ngram: int = 3, min_ngram: int = 2,
                          linear_dtype: str = "auto", decode: dict | None = None, sampled_union: bool = False) -> Any:
    """A trained head (:func:`load_head`) with prompt lookup (:class:`eval.decoding.lookup.LookupUnion`): greedy, the
    lookup's continuation drafts alone wherever it finds a match and the head elsewhere. ``sampled_union``: when
    sampling, the lookup's continuation joins the head's sampled draft as point-mass nodes (default false: the head
    drafts alone)."""
    from eval.decoding.lookup import LookupUnion, NGramDrafter

    return LookupUnion(load_head(path, target, linear_dtype, decode), NGramDrafter(max_ngram, min_ngram), lookup_k,
                       sampled_union)


def load_model_drafter(path: str, target: Any = None, dtype: str = "float32") -> Any:
    """An independent small causal LM (same tokenizer as the target) as the classic draft model."""
    from transformers import AutoModelForCausalLM

    from eval.decoding.lookup import ModelDrafter
    from models.target import DTYPES, resolve_path

    p = Path(shipped(path))
    if not (p / "config.json").exists():
        raise UserError(f"draft model {path}: no such model directory (train one with "
                        "`python -m train.embedded_target experiment_target=draft_model`)")
    model = AutoModelForCausalLM.from_pretrained(resolve_path(str(p)), dtype=DTYPES[dtype])
    if target is not None and model.config.vocab_size != target.vocab_size:
        raise UserError(f"draft model {path}: vocabulary {model.config.vocab_size} != target's {target.vocab_size}")
    return ModelDrafter(model)


def auto_k_factory(target: Any, max_k: int = 8, context: int = 256, reps: int = 7, max_nodes: int | None = None):
    """Measure the target's verify curve once (:func:`eval.decoding.autok.verify_costs`, up to ``max_nodes`` drafted tokens:
    the largest tree budget) → a factory of fresh :class:`eval.decoding.autok.AutoK` policies on it (``factory(tree)``: k is
    that tree's depth)."""
    from eval.decoding.autok import AutoK
    from eval.decoding.autok import verify_costs

    device = str(next(target.parameters()).device)
    costs = verify_costs(target.model, max(max_k, max_nodes or 0), context, reps, device)
    ratio = [c / costs[0] for c in costs]
    plan = getattr(target, "linear_kernels", {}).get("plans", {}).get("all")
    print("k=auto: verify cost T(1+d)/T(1) = " + ", ".join(f"{r:.2f}" for r in ratio) + f" (T(1) {costs[0] * 1e3:.1f} ms)"
          + (f"; the target's kernels by row count: {', '.join(f'{r}+ {k}' for r, k in plan)}" if plan else ""), flush=True)
    return lambda tree=None: AutoK(ratio, costs[0], max_k, tree)
