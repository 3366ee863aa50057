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
from typing import Any, Callable, Iterable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the checkout, or site-packages when installed: conf/ and assets/


def shipped(path: str | Path) -> str:
    """``path`` as given where it exists (or is absolute); else, for a relative path such as ``assets/smollm2-eagle``,
    the copy that ships with the package, so an installed tool finds its shipped heads from any directory."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return str(p)
    q = PACKAGE_ROOT / p
    return str(q) if q.exists() else str(path)


class UserError(Exception):
    """A mistake in the user's input (file, field, config). Printed as one line, exit code 2."""


def cli(fn: F) -> F:
    """Wrap a command's main: a UserError becomes `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _task_started
        _task_started = True
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


_task_started = False  # set by cli's wrapper: an exception raised before it is Hydra's (composing the config)


def run_main(main: Callable[[], Any]) -> Any:
    """Run a ``@hydra.main`` entry point (``if __name__ == "__main__": run_main(main)``) so that a config that
    does not compose (an unknown key, a malformed override, a missing group option) is one ``error:`` line
    and exit code 2 like every UserError, not Hydra's multi-line report with exit code 1."""
    global _task_started
    _task_started = False
    old = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing and exiting
    try:
        return main()
    except Exception as e:
        if _task_started:
            raise  # a failure inside the command: a bug, reported with its traceback
        lines = [l.strip().rstrip(".") for l in str(e).splitlines() if l.strip()]
        cause = e.__cause__
        if cause is not None and str(cause).strip():
            lines.append(str(cause).strip().splitlines()[0])
        bad = getattr(e, "override", None)  # hydra's OverrideParseException: the override that did not parse
        if isinstance(bad, str) and bad:
            lines.insert(0, f"cannot parse the override {bad!r}")
        msg = "; ".join(dict.fromkeys(lines)) or type(e).__name__
        print(f"error: config: {msg}", file=sys.stderr)
        sys.exit(2)
    finally:
        if old is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = old


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


def umask() -> int:
    """The process's umask (``os.umask`` can only be read by setting it; it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public(path: str | Path) -> Path:
    """Give ``path`` the mode the user's umask allows an ordinary file or folder (0644 / 0755 under umask 022).
    ``tempfile`` creates its files and folders private (0600 / 0700), and a rename keeps that mode: a serving
    container running as another user could not read the weights."""
    p = Path(path)
    os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask())
    return p


@contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` (never a half-written output), every
    file and folder in it with the mode the umask allows."""
    import shutil

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    public(tmp)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for p in tmp.rglob("*"):  # safetensors' save_file, like tempfile, writes its files private (0600)
        if not p.is_symlink():
            public(p)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(final: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary sibling file; on success rename it over `final` (with the mode the umask allows)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        public(tmp)
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def unwritable(folder: str | Path) -> str | None:
    """Why this process cannot create a file in ``folder`` (a real probe: a nameless temporary file, so it also
    sees read-only file systems and works as root), or None when it can."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_writable(path: str | Path, field: str) -> None:
    """One UserError unless ``path`` can be written: the nearest folder at or above its parent (where an atomic
    write puts its temporary sibling) and, when it exists, the folder itself."""
    p = Path(path).expanduser().absolute()
    above = p.parent
    while not above.exists() and above.parent != above:
        above = above.parent
    if not above.is_dir():
        raise UserError(f"{field}={path}: {above} is not a directory; choose another {field}=")
    for d in ([above, p] if p.is_dir() else [above]):
        why = unwritable(d)
        if why:
            raise UserError(f"{field}={path}: cannot write in {d} ({why}); choose another {field}= or make it writable")


def guard_out(out: str | Path, field: str = "out", ours: Callable[[Path], bool] | Iterable[str] = (),
              sources: Iterable[str | Path | None] = (), overwrite: bool = False, what: str = "an output of ours") -> Path:
    """The one check before a command writes a folder the user names (``out=``, ``out_dir=``, ``run_dir=``),
    done before the work starts so a mistake costs seconds, not hours. Refused in one line:

    - a path that exists and is not a folder, or is a link;
    - the working directory, or a source (``sources``), inside it, or it inside a source (never lifted);
    - a folder that holds something and is not ours (``ours``: a test of the folder, or the names, as
      ``fnmatch`` patterns, of everything the command writes there), unless ``overwrite``;
    - a folder that cannot be written (checked with a real probe).
    Returns the path (``~`` expanded)."""
    import fnmatch

    out = Path(out).expanduser()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{field}={out}: exists and is not a directory; choose another {field}=")
    here, res = Path.cwd().resolve(), out.resolve()
    if here == res or here.is_relative_to(res):
        raise UserError(f"{field}={out}: would replace the working directory; choose another {field}=")
    for src in sources:
        if src is None or str(src) == "" or not Path(str(src)).expanduser().exists():
            continue
        s = Path(str(src)).expanduser().resolve()
        if s == res or s.is_relative_to(res) or res.is_relative_to(s):
            raise UserError(f"{field}={out}: would write into or over the source {s}; choose another {field}= "
                            "outside the source")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if callable(ours):
            mine = not held or ours(out)
        else:
            pats = list(ours)
            mine = all(any(fnmatch.fnmatch(n, pat) for pat in pats) for n in held)
        if not mine and not overwrite:
            raise UserError(f"{field}={out}: exists and is not {what} (holds {', '.join(held[:4])}"
                            f"{', ...' if len(held) > 4 else ''}); choose another {field}= or pass overwrite=true to "
                            "replace it")
    check_writable(out, field)
    return out


def cache_root() -> Path:
    """The project cache: ``$DRAFTSMITH_CACHE``, default ``~/.cache/draftsmith`` (nothing is created here)."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith").expanduser()


def cache_folder(*parts: str, root: str | Path | None = None) -> Path:
    """``root`` (default :func:`cache_root`) / ``parts``, created, before a new entry is written there; one
    UserError naming the folder and the way out when it cannot be (an unwritable home, a read-only cache).
    Reading an entry that exists needs no call: a read-only cache keeps serving what it holds."""
    folder = Path(root or cache_root()).joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(f"cache folder {folder}: cannot create it ({why}); set DRAFTSMITH_CACHE to a writable "
                        "folder") from None
    why = unwritable(folder)
    if why:
        raise UserError(f"cache folder {folder}: cannot write in it ({why}); set DRAFTSMITH_CACHE to a writable "
                        "folder, or make it writable")
    return folder


def write_json(path: str | Path, obj, echo: bool = False) -> None:
    """Write ``obj`` as indented JSON atomically; with ``echo`` also print it and where it went."""
    import json

    with atomic_file(path) as f:
        json.dump(obj, f, indent=2)
    if echo:
        print(json.dumps(obj, indent=2))
        print(f"wrote {path}")


def read_json(path: str | Path, fmt: str | None = None) -> Any:
    """JSON from ``path``; malformed JSON, or (given ``fmt``) a ``format`` field other than ``fmt``, is one UserError
    naming the file (the reader of every self-describing folder: drafts, datastores, serving formats)."""
    import json

    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: malformed JSON ({e.msg})") from None
    if fmt is not None and (not isinstance(obj, dict) or obj.get("format") != fmt):
        raise UserError(f"{p}: format {obj.get('format') if isinstance(obj, dict) else None!r} is not {fmt!r}")
    return obj


def sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 4 MiB blocks (feature shards, GGUF files)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
