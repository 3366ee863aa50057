"""The ground floor: user-facing errors, the command wrapper, atomic writes and Hydra instantiation.

Every other module may import this one; it imports nothing of this project (see README, "Architecture").
A :class:`UserError` is one clear line, no traceback, exit code 2.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A mistake in the user's input (file, field, config). Printed as one line, exit code 2."""


def cli(fn: F) -> F:
    """Wrap a command's main: a UserError becomes `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def instantiate(node: Any, _partial_: bool = False, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets our one-line UserErrors through (Hydra wraps them) and names
    the config node when a constructor rejects its arguments (``_partial_``: a ``functools.partial``)."""
    import hydra
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, _convert_="all", _partial_=_partial_, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, TypeError):
            raise UserError(f"{node.get('_target_')}: {cause}") from None
        raise


@contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` (never a half-written output)."""
    import shutil

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(final: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary sibling file; on success rename it over `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str | Path, obj, echo: bool = False) -> None:
    """Write ``obj`` as indented JSON atomically; with ``echo`` also print it and where it went."""
    import json

    with atomic_file(path) as f:
        json.dump(obj, f, indent=2)
    if echo:
        print(json.dumps(obj, indent=2))
        print(f"wrote {path}")
