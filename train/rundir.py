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
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "launch": launch_id()}  # the other ranks of this launch join it (join_run_lock)
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


def launch_id() -> str | None:
    """What every process of one multi-process launch shares and another launch does not: torchrun's run id, or
    SLURM's job and step; None for a plain process (Lightning's own launcher starts ranks > 0 as children of rank 0,
    which :func:`join_run_lock` recognises by the parent pid)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return None


def join_run_lock(run_dir: str | Path, rank: int, timeout_s: float = 300.0, what: str = "run_dir") -> dict:
    """A rank > 0 takes part in rank 0's lock instead of taking its own: it waits (up to ``timeout_s``) for the lock
    of rank 0 of the same launch (its parent process under Lightning's launcher, or the same torchrun/SLURM launch)
    and refuses a lock held by another run. Returns the holder's record."""
    path = Path(run_dir) / LOCK
    mine, parent = launch_id(), os.getppid()
    deadline = time.monotonic() + timeout_s
    holder = None
    while time.monotonic() < deadline:
        try:
            holder = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):  # not taken yet, or being written
            holder = None
        if isinstance(holder, dict):
            ours = (mine is not None and holder.get("launch") == mine) or (
                holder.get("pid") == parent and holder.get("host") == socket.gethostname())
            if ours:
                return holder
            stale = holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])
            if stale:  # a killed run's: rank 0 takes it over
                time.sleep(0.2)
                continue
            if holder.get("launch") is not None or mine is None:  # another launch's lock, or not rank 0 of ours
                pid, host = holder.get("pid"), holder.get("host")
                raise UserError(f"{what}={run_dir} is in use by pid {pid} on {host} (since {holder.get('started')}; lock "
                                f"{path}), not by rank 0 of this launch (rank {rank}); wait for it, or choose another "
                                "name=/run_dir=")
        time.sleep(0.2)
    raise UserError(f"{what}={run_dir}: rank {rank} found no lock of this launch's rank 0 at {path} within {timeout_s:.0f} s "
                    "(rank 0 failed to start, or the ranks do not share the run folder)")


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
