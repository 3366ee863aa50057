"""A run folder belongs to one run at a time: a lock file with the owner's pid and host, taken before anything is
written; leftovers of killed runs and exports (temporary siblings of atomic writes) are swept by the next owner.

    with RunLock(run_dir):        # error: run_dir=runs/x is in use by pid 123 on host-a (since ...) ...
        sweep_leftovers(run_dir)
        ...

A lock whose pid is dead on this host is stale (a run killed with kill -9): it is taken over, with a note.
A lock from another host cannot be checked from here and is refused (delete it if that run is gone).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from data.errors import UserError

LOCK = ".lock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``run_dir/.lock`` (JSON: pid, host, started) created exclusively; removed on exit if still ours."""

    def __init__(self, run_dir: str | Path, what: str = "run_dir"):
        self.dir, self.what = Path(run_dir), what
        self.path = self.dir / LOCK
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treated as stale below

    def acquire(self) -> "RunLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                pid, host = holder.get("pid"), holder.get("host")
                if isinstance(pid, int) and host and host != self.mine["host"]:
                    raise UserError(f"{self.what}={self.dir} is in use by pid {pid} on host {host} (since {holder.get('started')}; "
                                    f"lock {self.path}); if that run is gone, delete the lock file")
                if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
                    raise UserError(f"{self.what}={self.dir} is in use by pid {pid} on {host} (since {holder.get('started')}; "
                                    f"lock {self.path}); wait for it, or choose another name=/run_dir=")
                print(f"note: taking over the stale lock of pid {pid} on {host} ({self.path}): that process is gone")
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
            self.held = True
            return self
        raise UserError(f"{self.what}={self.dir}: could not take the lock {self.path} (another run is starting there)")

    def release(self) -> None:
        if self.held and (self._holder() or {}).get("pid") == self.mine["pid"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def sweep_leftovers(folder: str | Path, names: list[str] | None = None) -> list[Path]:
    """Remove the temporary siblings atomic writes leave when killed (``.<name>.tmp-*``, ``.<name>.old-*``) in
    ``folder`` and its ``checkpoints/``: only for ``names`` if given, else for any name. Returns what went."""
    folder = Path(folder)
    gone = []
    for d in (folder, folder / "checkpoints"):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            n = p.name
            if not n.startswith(".") or not (".tmp-" in n or ".old-" in n):
                continue
            base = n[1:].split(".tmp-")[0].split(".old-")[0]
            if names is not None and base not in names:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p)
    if gone:
        print(f"note: removed {len(gone)} leftover(s) of an interrupted write: {', '.join(p.name for p in gone[:4])}")
    return gone
