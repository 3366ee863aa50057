"""Training: ``python -m train`` (draft heads), ``python -m train.embedded_target`` (the embedded target)."""
from __future__ import annotations

from functools import lru_cache

from omegaconf import OmegaConf


@lru_cache(maxsize=1)
def cpu_precision() -> str:
    """``bf16-mixed`` where the CPU multiplies bf16 in hardware tiles (AMX), else ``32``.

    bf16 autocast on a CPU with only AVX-512 BF16 is slower than fp32 (``python -m eval.bench_train``: 589 against
    937 tokens/s for EAGLE-3 training, a 2-core Intel Xeon without AMX, 2026-11-30), so the default follows the
    hardware rather than the flag alone.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return "32"
    return "bf16-mixed" if "amx_bf16" in flags.split() else "32"


if not OmegaConf.has_resolver("cpu_precision"):
    OmegaConf.register_new_resolver("cpu_precision", cpu_precision)
