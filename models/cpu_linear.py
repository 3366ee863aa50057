"""Linear layers with a CPU kernel chosen by measurement, per layer shape and per row count, for inference.

Why: a decoding step multiplies each weight by one row (plain decoding, a chain's draft step) or a few (verifying a
block of 2–16 tokens, a tree level, the tokens a round accepted), and no single CPU kernel is the fastest at every
row count on every CPU. Measured on two 2-core machines (2026-12-04):
- PyTorch's ``F.linear`` (MKL's sgemm on the weight as stored, out × in) costs about 2× one row at 2–4 rows on an
  AMD EPYC, and on a Xeon with AMX jumps 2–3× from 3 to 4 rows;
- MKL on a transposed copy of the weight (in × out: ``x @ Wᵀ``, ``mkl_t``) is the fastest one-row product on that
  Xeon (SmolLM2's step 34–36 ms against 42–44 ms with oneDNN everywhere), and slower than oneDNN at 2–8 rows there;
- oneDNN with the weight packed once ahead of time (the kernel inductor's CPU freezing uses; ``float32``) is 0.3–0.5×
  MKL's time at 2–16 rows on the AMD, but has a fixed cost of about 20 µs a call on the Xeon, most of a small
  layer's one-row product; ``bfloat16`` packs a bf16 copy (half the bytes; a draft's decoding only, where the
  verifier keeps the output exact whatever the draft computes).
So each layer becomes a :class:`PackedLinear` with a plan, which kernel serves which row counts, chosen by timing at
1, 2, 4 and 8 rows: for a target by :func:`choose_model_kernels` (whole forwards, kernels in its own precision; plain decoding
uses the same layers as verification, so the speed-up stays an honest ratio), for a draft by :func:`choose_kernels`
(each layer shape's layers in turn, bf16 packing and fused q/k/v and gate/up products included) (``python -m eval.bench_decode`` measures a whole target; ``target.fast_linear=
false``: ``F.linear`` throughout, ``packed``: oneDNN fp32 throughout).

The kernels differ in their last bits (another summation order), and a layer whose plan changes kernel between one
row and several gives plain decoding's one-row logits other last bits than a verify block's; the decoder's
numerical-tie classification (:mod:`eval.decoding.lossless`) tells such ties from defects.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("mkl", "mkl_t", "float32", "bfloat16")  # F.linear, MKL on Wᵀ, oneDNN packed fp32, oneDNN packed bf16
FP32_KINDS = ("mkl", "mkl_t", "float32")          # what an fp32 target may use: fp32 products only
BF16_KINDS = ("mkl", "mkl_t", "bfloat16")         # what a bf16 target may use: its own bf16 weights, packed or not
_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Plan = tuple[tuple[int, str], ...]                # ((first row count, kind), ...), ascending, starting at 1
_KINDS_OF = {torch.float32: KINDS, torch.bfloat16: BF16_KINDS}  # a layer's dtype → the kinds that serve it
_TARGET_KINDS = {torch.float32: FP32_KINDS, torch.bfloat16: BF16_KINDS}  # a target's dtype → its own precision's


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _kind_for(plan: Plan, rows: int) -> str:
    """The kernel ``plan`` gives an input of ``rows`` rows."""
    kind = plan[0][1]
    for first, k in plan[1:]:
        if rows < first:
            break
        kind = k
    return kind


def _derive(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The weight [out, in] as kernel ``kind`` reads it: transposed and contiguous, or packed by oneDNN."""
    if kind == "mkl_t":
        return w.t().contiguous()  # [in, out]
    return torch.ops.mkldnn._reorder_linear_weight(w.to(_DTYPE[kind]), None)


def _apply(x: torch.Tensor, kind: str, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., d_in] (fp32, or bf16 for a bf16 layer) through a derived weight → [..., d_out] in x's dtype."""
    if kind == "mkl_t":
        y = torch.matmul(x, w)
        return y if bias is None else y.add_(bias)
    if kind == "float32":
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w, bias, "none", [], "").to(x.dtype)


def _bias_for(bias: torch.Tensor | None, kind: str) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(_DTYPE.get(kind, torch.float32))


def _plan_of(dtype: torch.dtype, from_rows: int, below: str) -> Plan:
    kind = str(dtype).removeprefix("torch.")
    return ((1, kind),) if from_rows <= 1 else ((1, below), (from_rows, kind))


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` sharing ``weight``/``bias`` with the layer it replaces, whose CPU inputs of the weight's dtype
    (fp32, or bf16 for a bf16 layer) without autograd go through the kernel its ``plan`` gives their row count
    (``mkl``: ``F.linear``; ``mkl_t``: a transposed copy; ``float32``/``bfloat16``: a oneDNN-packed copy, fp32 inputs
    of a bf16 copy cast and outputs cast back). Copies are made again after the weight changed in place. The short form ``PackedLinear(lin, dtype, from_rows)``: the packed weight of
    ``dtype`` from ``from_rows`` rows on, MKL below."""

    def __init__(self, lin: nn.Linear, dtype: torch.dtype = torch.float32, from_rows: int = 1, plan: Plan | None = None):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        self.weight, self.bias = lin.weight, lin.bias  # the same Parameters (tied weights stay tied)
        self.set_plan(tuple(plan) if plan else _plan_of(dtype, from_rows, "mkl"))

    def set_plan(self, plan: Plan) -> None:
        """Serve each row count by ``plan``'s kernel (its copies of the weight made now, the others dropped)."""
        self.__dict__["plan"] = tuple(plan)
        self._pack()

    @property
    def kinds(self) -> set[str]:
        return {k for _, k in self.plan}

    def _pack(self) -> None:
        self.__dict__["_version"] = self._versions()
        w = self.weight.detach()
        self.__dict__["_w"] = {k: _derive(w, k) for k in self.kinds if k != "mkl"}
        self.__dict__["_b"] = {k: _bias_for(self.bias, k) for k in self.kinds if k != "mkl"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() == 0 or x.dtype != self.weight.dtype or x.dtype not in _KINDS_OF or x.device.type != "cpu"
                or self.weight.device.type != "cpu"
                or torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        kind = _kind_for(self.plan, x.numel() // self.in_features)
        if kind == "mkl":
            return F.linear(x, self.weight, self.bias)
        if self._versions() != self._version:  # an optimiser step or load_state_dict since packing
            self._pack()
        return _apply(x, kind, self._w[kind], self._b[kind])

    def _versions(self) -> tuple[int, int]:
        return self.weight._version, -1 if self.bias is None else self.bias._version


class FusedLinears:
    """Linear layers that read the same input (q/k/v, gate/up) as one product, for inference.

    A one-row draft step is mostly per-call cost on a 2-core CPU (a drafted EAGLE-3 token on SmolLM2: 8 products
    of 0.1–5 M weights, 72% of its time; 2026-11-30), so three products in one call save two calls' overhead. The concatenated
    weight is a copy, made again once a source weight has changed in place. ``plan`` as :class:`PackedLinear`'s, with
    ``apart`` for row counts where the layers run one by one (the short form: ``dtype`` from ``from_rows`` rows on);
    :meth:`__call__` returns None (the caller uses the separate layers) there, under autograd, and for inputs that
    are not fp32 on a CPU."""

    def __init__(self, *lins: nn.Linear, dtype: torch.dtype = torch.float32, from_rows: int = 1, plan: Plan | None = None):
        self.lins, self.sizes = lins, [lin.out_features for lin in lins]
        self.plan = tuple(plan) if plan else _plan_of(dtype, from_rows, "apart")
        self._pack()

    def _versions(self) -> list[int]:
        return [t._version for lin in self.lins for t in (lin.weight, lin.bias) if t is not None]

    def _pack(self) -> None:
        self.versions = self._versions()
        w = torch.cat([lin.weight.detach() for lin in self.lins])
        biases = [lin.bias for lin in self.lins]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, self.lins)])
        kinds = {k for _, k in self.plan if k != "apart"}
        self.w = {k: _derive(w, k) for k in kinds}
        self.b = {k: _bias_for(bias, k) for k in kinds}

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """x [..., d_in] → one output [..., out_i] per layer, or None where the fused product must not be used."""
        if torch.is_grad_enabled() or x.numel() == 0 or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        kind = _kind_for(self.plan, x.numel() // self.lins[0].in_features)
        if kind == "apart":
            return None
        if self._versions() != self.versions:
            self._pack()
        return _apply(x, kind, self.w[kind], self.b[kind]).split(self.sizes, -1)


def fused(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of ``module``'s :class:`FusedLinears` on x (set by :func:`pack_linears`), or None."""
    f = module.__dict__.get("_fused")
    return f(x) if f is not None else None


def _plain_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every plain CPU ``nn.Linear`` of ``dtype`` in ``model``."""
    return [(parent, name, child) for parent in list(model.modules()) for name, child in list(parent.named_children())
            if type(child) is nn.Linear and child.weight.dtype == dtype and child.weight.device.type == "cpu"]


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear` of one packed weight in
    ``dtype`` for every row count; returns how many. Modules that name the linears reading one input
    (``fused_linears``: q/k/v, gate/up) also get a :class:`FusedLinears` of them. A no-op (0) where oneDNN is
    missing or the check of one layer disagrees with ``F.linear`` (bf16: within its rounding)."""
    if not available():
        return 0
    done = 0
    for parent, name, child in _plain_linears(model):
        if done == 0:  # one check that the op works here and agrees with MKL
            packed = _checked_pack(child, dtype, torch.Generator().manual_seed(0))
            if packed is None:
                return 0
        else:
            packed = PackedLinear(child, dtype)
        setattr(parent, name, packed)
        done += 1
    for m in model.modules():
        lins = [getattr(m, n) for n in getattr(m, "fused_linears", ())]
        if done and lins and all(lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu" for lin in lins):
            m.__dict__["_fused"] = FusedLinears(*lins, dtype=dtype)
    return done


def _checked_pack(lin: nn.Linear, dtype: torch.dtype, gen: torch.Generator, rows: int = 3) -> PackedLinear | None:
    """``lin`` packed in ``dtype``, or None where this build or CPU has no such kernel (packing bf16 raises without
    AVX-512) or its product disagrees with ``F.linear`` (fp32: 1e-4; bf16: within its rounding, 2e-2)."""
    tol = 1e-4 if dtype == lin.weight.dtype == torch.float32 else 2e-2
    x = torch.randn(rows, lin.in_features, generator=gen).to(lin.weight.dtype)
    try:
        packed = PackedLinear(lin, dtype)
        with torch.no_grad():
            ref = F.linear(x, lin.weight, lin.bias)
            ok = torch.allclose(packed(x).float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max().clamp_min(1)))
    except RuntimeError:
        return None
    return packed if ok else None


def _usable(kinds: Iterable[str], lin: nn.Linear, gen: torch.Generator) -> list[str]:
    """The kinds that run here: the MKL ones always, a packed one where oneDNN packs ``lin`` and agrees with MKL."""
    return [k for k in kinds if k in ("mkl", "mkl_t") or available() and _checked_pack(lin, _DTYPE[k], gen) is not None]


def _us_per_call(fs: list[Callable], x: torch.Tensor, reps: int = 5) -> float:
    """Median over ``reps`` passes of one call of each f in ``fs`` on x, in µs a call (one unrecorded pass first).
    A pass over every layer of a shape reads their weights from memory, as a forward pass does."""
    with torch.no_grad():
        for f in fs:
            f(x)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in fs:
                f(x)
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] / len(fs) * 1e6


def _best_plan(times: dict[str, list[float]], rows: tuple[int, ...], margin: float = 0.05) -> Plan:
    """Per row count the kind of least time, unless a neighbouring row count's kind is within ``margin`` of it there
    (fewer switches: timing noise decides nothing, and one kernel across row counts keeps one summation order);
    consecutive row counts of one kind merged."""
    kinds = [min(times, key=lambda k: times[k][i]) for i in range(len(rows))]
    close = lambda k, i: times[k][i] <= times[kinds[i]][i] * (1 + margin)  # noqa: E731
    for i in reversed(range(len(rows) - 1)):  # a kind that also wins more rows takes fewer where it is close
        if close(kinds[i + 1], i):
            kinds[i] = kinds[i + 1]
    for i in range(1, len(rows)):
        if close(kinds[i - 1], i):
            kinds[i] = kinds[i - 1]
    plan: list[tuple[int, str]] = []
    for r, kind in zip(rows, kinds):
        if not plan or plan[-1][1] != kind:
            plan.append((1 if not plan else r, kind))
    return tuple(plan)


def choose_kernels(model: nn.Module, kinds: Iterable[str] = KINDS, rows: tuple[int, ...] = (1, 2, 4, 8),
                   fuse: bool = True) -> dict:
    """Give each plain fp32 CPU ``nn.Linear`` of ``model`` the fastest of ``kinds`` at each row count of ``rows``
    (timed here, all layers of one shape together), and, with ``fuse``, each module's ``fused_linears`` one
    :class:`FusedLinears` for the row counts where that beats its layers one by one. A layer whose plan is
    ``F.linear`` throughout stays as it is. Which kernel wins depends on the CPU, the shape and the row count (see
    the module's docstring), so it is measured, not assumed. Returns the counts: ``replaced`` and ``kept`` layers,
    per kind the (layer, row count) pairs it serves, ``fused`` modules, and ``plans`` (shape → plan)."""
    layers = _plain_linears(model)
    counts: dict = {"replaced": 0, "kept": 0, "fused": 0, **{k: 0 for k in KINDS}, "plans": {}}
    if not layers:
        return counts
    gen = torch.Generator().manual_seed(0)
    kinds = _usable(kinds, layers[0][2], gen)
    groups: dict[tuple, list] = defaultdict(list)
    for entry in layers:
        lin = entry[2]
        groups[(lin.in_features, lin.out_features, lin.bias is not None)].append(entry)
    for (d_in, d_out, _), entries in groups.items():
        lins = [e[2] for e in entries]
        xs = [torch.randn(r, d_in, generator=gen) for r in rows]
        times = {}
        for k in kinds:
            fs = lins if k == "mkl" else [PackedLinear(lin, plan=((1, k),)) for lin in lins]
            times[k] = [_us_per_call(fs, x) for x in xs]
        plan = _best_plan(times, rows)
        counts["plans"][f"{d_in}x{d_out}"] = plan
        for r in rows:
            counts[_kind_for(plan, r)] += len(lins)
        if plan == ((1, "mkl"),):
            counts["kept"] += len(lins)
            continue
        for parent, name, lin in entries:
            setattr(parent, name, PackedLinear(lin, plan=plan))
        counts["replaced"] += len(lins)
    if fuse:
        for m in model.modules():
            lins = [getattr(m, n) for n in getattr(m, "fused_linears", ())]
            if not lins or not all(isinstance(lin, nn.Linear) and lin.weight.dtype == torch.float32
                                    and lin.weight.device.type == "cpu" for lin in lins):
                continue
            xs = [torch.randn(r, lins[0].in_features, generator=gen) for r in rows]
            times = {"apart": [_us_per_call([lambda v: [lin(v) for lin in lins]], x) for x in xs]}
            for k in (k for k in kinds if k != "mkl"):
                f = FusedLinears(*lins, plan=((1, k),))
                times[k] = [_us_per_call([f], x) for x in xs]
            plan = _best_plan(times, rows)
            if plan != ((1, "apart"),):
                m.__dict__["_fused"] = FusedLinears(*lins, plan=plan)
                counts["fused"] += 1
    return counts


def choose_model_kernels(model: nn.Module, step: Callable[[int], object], kinds: Iterable[str] | None = None,
                         rows: tuple[int, ...] = (1, 2, 4, 8), rounds: int = 2, reps: int = 2,
                         slow_s: float = 0.25) -> dict:
    """For a target: one kernel for all of ``model``'s plain CPU linear layers (fp32, or bf16 for a bf16 model) per
    row count of ``rows``, among ``kinds`` (default: products in the model's own precision, :data:`FP32_KINDS` or
    :data:`BF16_KINDS`), the one whose whole forward ``step(r)`` (r tokens) took least time here. Whole forwards, not layers timed apart: a layer's product costs what it costs
    between the others (its weights streamed from memory, the caches holding the others'), which timing it alone
    does not show. ``rounds`` passes over the kinds, each step timed ``reps`` times after one unrecorded call; the
    least median wins (a model whose one-token step takes over ``slow_s`` gets one round of one timing: a few dozen
    forwards of a large model would take minutes). Every layer becomes a :class:`PackedLinear` with the plan
    (``F.linear`` throughout leaves them as they are). Returns ``replaced``, ``kept``, ``plans`` ({"all": plan})
    and ``step_ms`` (kind → ms per row count)."""
    dtype = next(model.parameters()).dtype
    layers = _plain_linears(model, dtype)
    out: dict = {"replaced": 0, "kept": len(layers), "plans": {}, "step_ms": {}}
    if not layers or dtype not in _KINDS_OF:
        return out
    kinds = [k for k in (kinds or _TARGET_KINDS[dtype]) if k in _KINDS_OF[dtype]]
    kinds = _usable(kinds, layers[0][2], torch.Generator().manual_seed(0))
    swapped = [PackedLinear(lin, plan=((1, "mkl"),)) for _, _, lin in layers]
    for (parent, name, _), p in zip(layers, swapped):
        setattr(parent, name, p)
    best: dict[str, list[float]] = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        step(1)
        if time.perf_counter() - t0 > slow_s:
            rounds, reps = 1, 1
        for _ in range(rounds):
            for k in kinds:
                for p in swapped:
                    p.set_plan(((1, k),))
                ms = []
                for r in rows:
                    step(r)
                    ts = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        step(r)
                        ts.append(time.perf_counter() - t0)
                    ms.append(sorted(ts)[(reps - 1) // 2] * 1e3)
                best[k] = [min(a, b) for a, b in zip(best[k], ms)] if k in best else ms
    plan = _best_plan(best, rows)
    out["plans"]["all"], out["step_ms"] = plan, {k: [round(t, 3) for t in v] for k, v in best.items()}
    if plan == ((1, "mkl"),):
        for (parent, name, lin), _ in zip(layers, swapped):
            setattr(parent, name, lin)
        return out
    for p in swapped:
        p.set_plan(plan)
    out["replaced"], out["kept"] = len(layers), 0
    return out


def pack_fastest(model: nn.Module, rows: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """For a draft's decoding: :func:`choose_kernels` over every kind, bf16 packing included, and fused q/k/v and
    gate/up products; {} where oneDNN is missing."""
    if not available():
        return {}
    return choose_kernels(model, KINDS, rows)
