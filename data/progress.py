"""Progress of long jobs (evaluation, feature extraction, regeneration): a tqdm bar on a terminal, and on a pipe or a
log file a plain line at most every ``every_s`` seconds, so a job that runs for an hour behind ``| tee`` still says
where it is and how long is left."""
from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """``with Progress(total, "eval") as p: ... p.update(1, note="τ=2.1")``; ``total`` in units of work."""

    def __init__(self, total: int, desc: str, unit: str = "it", every_s: float = 30.0, file: Any = None,
                 initial: int = 0):
        self.total, self.desc, self.unit, self.every_s = max(int(total), 0), desc, unit, every_s
        self.file = file if file is not None else sys.stderr
        self.n = self.start_n = int(initial)
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if getattr(self.file, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=desc, unit=unit, initial=initial, file=self.file, dynamic_ncols=True)

    def update(self, n: int = 1, note: str = "") -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            print(self.line(note), file=self.file, flush=True)

    def line(self, note: str = "") -> str:
        """``eval: 12/60 prompts (20%), 3m05s elapsed, ~12m20s left, τ=2.1``: time left from this process's rate."""
        done = self.n - self.start_n
        elapsed = time.perf_counter() - self.t0
        left = elapsed / done * (self.total - self.n) if done > 0 else None
        pct = f" ({self.n / self.total:.0%})" if self.total else ""
        parts = [f"{self.desc}: {self.n}/{self.total} {self.unit}{pct}", f"{_hms(elapsed)} elapsed"]
        if left is not None and self.n < self.total:
            parts.append(f"~{_hms(left)} left")
        return ", ".join(parts + ([note] if note else []))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _hms(s: float) -> str:
    s = int(s)
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
