"""fp32 linear layers through oneDNN with pre-packed weights, for a frozen target on a CPU.

Why: verifying a block of 2–16 tokens multiplies each weight by a few rows. PyTorch's CPU build sends that
to MKL's sgemm, which on the CPU we measured (AMD EPYC, 2 cores) costs 2× one row at 2 rows and about 2.3×
at 4–8 rows for SmolLM2's 49,152 × 576 output head, so a verify pass of 4 tokens cost 1.65–1.8× a one-token
step where the weights are read once either way. oneDNN with the weight packed once ahead of time (the kernel
inductor's CPU freezing uses) does the same product at 0.3–0.5× of MKL's time for 2–16 rows, and on the whole
model it is also faster for one row (a SmolLM2 step: 77.5 against 88.3 ms), so every row count goes through
it: plain decoding gets the same improvement as verification, and the speed-up stays an honest ratio.
``python -m eval.bench_decode`` measures the effect on a whole target (``target.fast_linear=false``: MKL).

The results differ from MKL's in the last bits (another summation order), as any change of kernel does; the
decoder's numerical-tie classification (:mod:`eval.lossless`) covers that.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` sharing ``weight``/``bias`` with the layer it replaces, plus a oneDNN-packed copy of the
    weight that fp32 CPU inputs without autograd go through (packed again after the weight changed in place).
    ``dtype=torch.bfloat16`` packs a bf16 copy: half the bytes a product reads, inputs cast to bf16 and outputs
    back to fp32 (for a draft's decoding, where the verifier keeps the output exact whatever the draft computes).
    ``from_rows``: inputs of fewer rows keep MKL's product (:func:`pack_fastest` sets it where MKL wins one row and
    the packed weight several)."""

    def __init__(self, lin: nn.Linear, dtype: torch.dtype = torch.float32, from_rows: int = 1):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        self.weight, self.bias = lin.weight, lin.bias  # the same Parameters (tied weights stay tied)
        self.__dict__["_dtype"] = dtype
        self.__dict__["_from_numel"] = from_rows * lin.in_features
        self._pack()

    def _pack(self) -> None:
        self.__dict__["_version"] = self._versions()
        self.__dict__["_packed"] = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().to(self._dtype), None)
        self.__dict__["_bias"] = None if self.bias is None else self.bias.detach().to(self._dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() == 0 or x.numel() < self._from_numel or x.dtype != torch.float32 or x.device.type != "cpu"
                or self.weight.device.type != "cpu" or torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        if self._versions() != self._version:  # an optimiser step or load_state_dict since packing
            self._pack()
        return _product(x, self._packed, self._bias, self._dtype)

    def _versions(self) -> tuple[int, int]:
        return self.weight._version, -1 if self.bias is None else self.bias._version


class FusedLinears:
    """Linear layers that read the same input (q/k/v, gate/up) as one packed product, for inference.

    A one-row draft step is mostly per-call cost on these CPUs (a drafted EAGLE-3 token on SmolLM2: 8 products
    of 0.1–5 M weights, 72% of its time), so three products in one call save two calls' overhead. The packed weight
    is a copy, packed again once a source weight has changed in place (an optimiser step, ``load_state_dict``);
    :meth:`__call__` returns None (the caller uses the separate layers) under autograd, for inputs that are not
    fp32 on a CPU and for inputs of fewer than ``from_rows`` rows."""

    def __init__(self, *lins: nn.Linear, dtype: torch.dtype = torch.float32, from_rows: int = 1):
        self.lins, self.sizes, self.dtype = lins, [lin.out_features for lin in lins], dtype
        self.from_numel = from_rows * lins[0].in_features
        self._pack()

    def _versions(self) -> list[int]:
        return [t._version for lin in self.lins for t in (lin.weight, lin.bias) if t is not None]

    def _pack(self) -> None:
        self.versions = self._versions()
        w = torch.cat([lin.weight.detach() for lin in self.lins]).to(self.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        biases = [lin.bias for lin in self.lins]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, self.lins)]
        ).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """x [..., d_in] → one output [..., out_i] per layer, or None where the fused product must not be used."""
        if (torch.is_grad_enabled() or x.numel() == 0 or x.numel() < self.from_numel or x.dtype != torch.float32
                or x.device.type != "cpu"):
            return None
        if self._versions() != self.versions:
            self._pack()
        return _product(x, self.packed, self.bias, self.dtype).split(self.sizes, -1)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x [..., d_in] times a packed weight of ``dtype`` → fp32 [..., d_out]."""
    if dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, bias, "none", [], "").float()


def fused(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of ``module``'s :class:`FusedLinears` on x (set by :func:`pack_linears`), or None."""
    f = module.__dict__.get("_fused")
    return f(x) if f is not None else None


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear` (weights packed in
    ``dtype``: fp32, or bf16 for a draft's decoding); returns how many. Modules that name the linears reading one
    input (``fused_linears``: q/k/v, gate/up) also get a :class:`FusedLinears` of them. A no-op (0) where oneDNN is
    missing or the check of one layer disagrees with ``F.linear`` (bf16: within its rounding)."""
    if not available():
        return 0
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                if done == 0:  # one check that the op works here and agrees with MKL
                    packed = _checked_pack(child, dtype, torch.Generator().manual_seed(0))
                    if packed is None:
                        return 0
                else:
                    packed = PackedLinear(child, dtype)
                setattr(parent, name, packed)
                done += 1
    for m in model.modules():
        names = getattr(m, "fused_linears", ())
        lins = [getattr(m, n) for n in names]
        if done and lins and all(lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu" for lin in lins):
            m.__dict__["_fused"] = FusedLinears(*lins, dtype=dtype)
    return done


def _checked_pack(lin: nn.Linear, dtype: torch.dtype, gen: torch.Generator, rows: int = 3) -> PackedLinear | None:
    """``lin`` packed in ``dtype``, or None where this build or CPU has no such kernel (packing bf16 raises without
    AVX-512) or its product disagrees with ``F.linear`` (fp32: 1e-4; bf16: within its rounding, 2e-2)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    x = torch.randn(rows, lin.in_features, generator=gen)
    try:
        packed = PackedLinear(lin, dtype)
        with torch.no_grad():
            ref = F.linear(x, lin.weight, lin.bias)
            ok = torch.allclose(packed(x), ref, rtol=tol, atol=tol * float(ref.abs().max().clamp_min(1)))
    except RuntimeError:
        return None
    return packed if ok else None


def _median_us(f, x: torch.Tensor, reps: int = 15) -> float:
    """Median wall time of f(x) in µs after two warm-up calls."""
    with torch.no_grad():
        f(x), f(x)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(x)
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e6


def pack_fastest(model: nn.Module, rows: tuple[int, int] = (1, 3)) -> dict[str, int]:
    """For a draft's decoding: give each plain fp32 CPU ``nn.Linear`` of ``model`` the fastest of MKL's product (left
    as it is), a :class:`PackedLinear` in fp32 or bf16, or one that keeps MKL for a single row, and each module's
    ``fused_linears`` one :class:`FusedLinears` (fp32 or bf16, for every row count or from 2 rows) where that beats
    its layers one by one. Each choice is timed here on one row and on ``rows[1]`` rows, and wins by the sum of the
    two: a draft multiplies one row (a chain's step) and several (a tree level, the accepted tokens a round
    extends the context with). Which is fastest depends on the CPU, the shape and the row count (on a 2-core AMD
    EPYC: MKL for one row of the decoder layer's products, oneDNN's packed fp32 weight for 2–4 rows, where MKL
    costs about twice its one-row time; packing for the output head at any row count), so it is measured, not
    assumed. Returns how many layers took each kernel (``mkl_one_row``: packed layers that keep MKL for one row)
    and how many modules fused; {} where oneDNN is missing."""
    if not available():
        return {}
    one, several = rows
    counts = {"mkl": 0, "float32": 0, "bfloat16": 0, "mkl_one_row": 0, "fused": 0}
    ok = {torch.float32: None, torch.bfloat16: None}  # whether this build's kernel runs and agrees with F.linear
    gen = torch.Generator().manual_seed(0)

    def timed(f: Callable, d_in: int) -> tuple[float, float]:
        return tuple(_median_us(f, torch.randn(r, d_in, generator=gen)) for r in (one, several))

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
                continue
            t = {"mkl": timed(child, child.in_features)}
            packed = {}
            for dt in (torch.float32, torch.bfloat16):
                if ok[dt] is False:
                    continue
                p = _checked_pack(child, dt, gen) if ok[dt] is None else PackedLinear(child, dt)  # first layer: checked
                ok[dt] = p is not None
                if ok[dt]:
                    packed[dt] = p
                    t[dt] = timed(p, child.in_features)
            # (total time, what): MKL, a packed weight for every row count, or MKL for one row and packed for more
            cands = [(sum(t["mkl"]), None, 0)] + [c for dt in packed for c in (
                (sum(t[dt]), dt, 1), (t["mkl"][0] + t[dt][1], dt, 2))]
            _, dt, from_rows = min(cands, key=lambda c: c[0])
            if dt is None:
                counts["mkl"] += 1
                continue
            counts[str(dt).removeprefix("torch.")] += 1
            counts["mkl_one_row"] += from_rows > 1
            setattr(parent, name, PackedLinear(child, dt, from_rows) if from_rows > 1 else packed[dt])
    for m in model.modules():
        lins = [getattr(m, n) for n in getattr(m, "fused_linears", ())]
        if not lins or not all(isinstance(lin, nn.Linear) and lin.weight.dtype == torch.float32
                                and lin.weight.device.type == "cpu" for lin in lins):
            continue
        apart = timed(lambda v: [lin(v) for lin in lins], lins[0].in_features)  # each layer with its own choice
        cands = [(sum(apart), None)]
        for dt in (torch.float32, torch.bfloat16):
            if ok[dt]:
                f = FusedLinears(*lins, dtype=dt)
                tf = timed(f, lins[0].in_features)
                cands += [(sum(tf), f), (apart[0] + tf[1], FusedLinears(*lins, dtype=dt, from_rows=2))]
        _, best = min(cands, key=lambda c: c[0])
        if best is not None:
            m.__dict__["_fused"] = best
            counts["fused"] += 1
    return counts
