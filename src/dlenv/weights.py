"""Weights files from elsewhere: safetensors as the exchange format, and consent before unpickling.

A weights file reaches dlenv in one of two formats, and each may do a different amount:

safetensors (`*.safetensors`)
    A JSON header of names, dtypes and shapes, then raw tensor bytes: reading it runs no code, on any
    PyTorch. `--weights x.safetensors` works for train, val, prune and export, and
    `dlenv export --format safetensors` writes one: the model's weights plus, as string metadata, its
    architecture, class names, image size and options, so val, prune and export rebuild the model from
    the file alone. A safetensors file from another tool is a bare state dict (name its --model).

pickle (`.pth`, `.pt`, anything else)
    torch.load(weights_only=True) refuses arbitrary globals, but before PyTorch 2.10 its unpickler can
    be made to run code by a crafted file: CVE-2025-32434 (fixed in 2.6) and CVE-2026-24747 (memory
    corruption, fixed in 2.10). On such a PyTorch (the default profile's 1.13.1;
    `compat.WEIGHTS_ONLY_TRUSTED` is False) a pickle is opened only when
      - the user consents for this one command with --trust-pickle (a YAML file cannot consent), or
      - dlenv wrote the file in this project. Every checkpoint dlenv saves gets a sidecar
        `<file>.hmac` with HMAC-SHA256 of the file's bytes under a secret key of the project: 32
        random bytes in `.dlenv/key` of the folder dlenv runs in (the project root; /root/workspace in
        the image; DLENV_KEY_FILE names another file), created 0600 on the first save and never
        written into a run folder or a checkpoint. A downloaded file cannot carry a MAC under your key,
        so it never passes, and a file of yours that was changed afterwards does not pass either.
    Anything else stops before the first byte is unpickled, with one line that says why and offers
    safetensors or --trust-pickle.

The sidecar lists the MAC of the file and of the ones it replaced: the checkpoint writer writes the
sidecar first and renames the checkpoint into place second, so a crash between the two leaves a pair
that still verifies. The MAC covers the bytes that are then unpickled from the same open file.

No torch import at module level: the CLI imports this module for --help.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dlenv.atomic import write_atomic, write_text
from dlenv.errors import UserError

SUFFIX = ".safetensors"
SIDECAR = ".hmac"
KEY_ENV = "DLENV_KEY_FILE"
#: MACs kept in a sidecar: the file's own and those of the files it replaced (see the module doc)
_KEEP = 3
#: domain separation: a MAC made here means "a dlenv weights file", nothing else
_CONTEXT = b"dlenv-weights-hmac/1\0"

_trust = False
_warned_key = False


# ---------------------------------------------------------------------------------------------------
# Consent


@contextlib.contextmanager
def trust_pickle(given: bool) -> Iterator[None]:
    """Within the block, unpickle any file (the user vouched for its source with --trust-pickle)."""
    global _trust
    old, _trust = _trust, bool(given) or _trust
    try:
        yield
    finally:
        _trust = old


def command_line_consent(cfg: Any, given: dict[str, Any]) -> Any:
    """`cfg` with trust_pickle as typed on the command line: a value from a YAML file is dropped, so a
    config file someone sends cannot switch the check off (nor pass it on to torchrun workers)."""
    if not hasattr(cfg, "trust_pickle"):
        return cfg
    import dataclasses

    typed = given.get("trust_pickle", False)
    typed = typed is True or str(typed).strip().lower() in ("1", "true", "yes", "on")
    return dataclasses.replace(cfg, trust_pickle=typed)


# ---------------------------------------------------------------------------------------------------
# The project key and the sidecar


def key_path() -> Path:
    """Where the project key lives: DLENV_KEY_FILE, else .dlenv/key in the working directory."""
    return Path(os.environ.get(KEY_ENV) or Path.cwd() / ".dlenv" / "key")


def _read_key(path: Path) -> bytes | None:
    try:
        text = path.read_text(encoding="ascii").strip()
        key = bytes.fromhex(text)
    except (OSError, ValueError):
        return None
    return key if len(key) >= 32 else None


def _create_key(path: Path) -> bytes:
    """32 random bytes in `path` (0600); if another process made one first, that one. Raises OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(secrets.token_hex(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileExistsError):  # another process made one first: use that one
            os.link(tmp, path)  # link, not rename: never replaces a key, whose signatures would all break
    finally:
        tmp.unlink(missing_ok=True)
    key = _read_key(path)
    if key is None:
        raise OSError(f"{path} holds no key (expected 64 hex digits)")
    return key


def project_key(create: bool = False) -> bytes | None:
    """The project's key, or None when there is none (and `create` is False). Raises OSError when it
    must be created and cannot be."""
    path = key_path()
    key = _read_key(path)
    if key is None and create and not path.exists():
        key = _create_key(path)
    return key


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


def _mac(fh: BinaryIO, key: bytes) -> str:
    h = hmac.new(key, _CONTEXT, hashlib.sha256)
    for block in iter(lambda: fh.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def _macs(path: Path) -> list[str]:
    try:
        data = json.loads(sidecar(path).read_text(encoding="utf-8"))
        macs = data["hmac-sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [m for m in macs if isinstance(m, str)] if isinstance(macs, list) else []


def sign(tmp: Path, path: Path) -> bool:
    """Record the MAC of `tmp`, about to be renamed to `path`, in `path`'s sidecar (before the rename).

    Returns False, after one note on stderr per process, when the project key cannot be made or read:
    the file is still written, and loads on PyTorch < 2.10 only with --trust-pickle.
    """
    global _warned_key
    try:
        key = project_key(create=True)
        if key is None:
            raise OSError(f"{key_path()} is not a dlenv key")
        with open(tmp, "rb") as fh:
            new = _mac(fh, key)
        write_text(sidecar(path), json.dumps({"hmac-sha256": [new, *_macs(path)][:_KEEP]}) + "\n")
        return True
    except OSError as e:
        if not _warned_key:
            _warned_key = True
            print(f"dlenv: cannot sign {path.name} with the project key {key_path()} ({e.strerror or e}); "
                  "on PyTorch < 2.10 it will load only with --trust-pickle", file=sys.stderr, flush=True)
        return False


def _signed_by_us(fh: BinaryIO, path: Path) -> bool:
    macs = _macs(path)
    key = project_key() if macs else None
    if key is None:
        return False
    mine = _mac(fh, key)
    return any(hmac.compare_digest(mine, m) for m in macs)


# ---------------------------------------------------------------------------------------------------
# Loading


def is_safetensors(path: str | Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


def refusal(path: Path) -> str:
    """The one line that stops an unvouched pickle on a PyTorch whose weights_only loader can be beaten."""
    import torch

    return (f"refusing to unpickle {path}: dlenv did not write it in this project (no valid {path.name}{SIDECAR} "
            f"under {key_path()}), and PyTorch {torch.__version__}'s weights_only loader can be made to run "
            "code by a crafted file (CVE-2025-32434, CVE-2026-24747; fixed in 2.10). Use a .safetensors "
            "file (see docs/weights.md), or pass --trust-pickle if you trust where this file came from")


def load(path: str | Path, map_location: Any = "cpu") -> Any:
    """The contents of a weights file: safetensors directly; a pickle with torch.load(weights_only=True)
    where that is trusted, vouched for or signed by this project (see the module doc).

    Raises UserError for a refused pickle or an unreadable safetensors file; torch.load's own errors
    (corrupt file, unknown global) propagate to the caller.
    """
    path = Path(path)
    if is_safetensors(path):
        return load_safetensors(path)
    from dlenv import compat

    with open(path, "rb") as fh:
        if not (compat.WEIGHTS_ONLY_TRUSTED or _trust or _signed_by_us(fh, path)):
            raise UserError(refusal(path))
        fh.seek(0)
        return compat.load_weights_only(fh, map_location=map_location)


def load_safetensors(path: Path) -> dict[str, Any]:
    """A .safetensors file: a dlenv-shaped checkpoint dict when dlenv wrote it (its metadata names the
    format), else the bare state dict. Tensors on the CPU. Raises UserError for an unreadable file."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise UserError(f"{path}: reading .safetensors needs the safetensors package "
                        "(in requirements.txt: pip install -r requirements.txt)") from None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    except Exception as e:  # SafetensorError, OSError, a bad header: all mean "cannot read this file"
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0][:160]
        raise UserError(f"{path} is not a readable safetensors file ({first}); export it again, or check "
                        "that the download finished") from None
    if "format" not in meta:
        return state
    try:
        return {"format": meta["format"], "model": state, "model_name": meta["model_name"],
                "num_classes": int(meta["num_classes"]), "class_names": json.loads(meta["class_names"]),
                "img_size": int(meta["img_size"]) if meta.get("img_size") else None,
                "config": json.loads(meta.get("config") or "{}")}
    except (KeyError, ValueError) as e:
        raise UserError(f"{path}: its dlenv metadata is incomplete ({e}); load it as a bare state dict "
                        "with --model NAME, or export it again") from None


# ---------------------------------------------------------------------------------------------------
# Writing


def save_safetensors(state: dict[str, Any], path: str | Path) -> Path:
    """Write the weights of `state` as .safetensors, atomically; returns the path.

    `state` is a dlenv checkpoint (its "model" and, as metadata, architecture, classes, image size and
    options; optimizer and RNG states are not weights and are left out) or a bare state dict.
    """
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    meta: dict[str, str] = {}
    weights = state
    if isinstance(state.get("model"), dict) and "format" in state:
        weights = state["model"]
        meta = {"format": str(state["format"]), "model_name": str(state["model_name"]),
                "num_classes": str(int(state["num_classes"])),
                "class_names": json.dumps(list(state["class_names"])),
                "img_size": str(int(state["img_size"])) if state.get("img_size") else "",
                "config": json.dumps(state.get("config") or {}, default=str)}
    # own contiguous copies: safetensors refuses tensors that share memory (tied or viewed weights)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items() if torch.is_tensor(v)}
    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def export(ckpt: dict[str, Any], model: Any, out: Path) -> int:
    """`dlenv export --format safetensors`: `model`'s weights and `ckpt`'s description to `out`, then
    read back and compared tensor by tensor. Returns 0 when identical, 1 when not (the file is kept)."""
    import torch

    state = {**ckpt, "model": model.state_dict()}
    save_safetensors(state, out)
    back = load_safetensors(out)
    want = state["model"]
    same = (set(back["model"]) == set(want)
            and all(torch.equal(back["model"][k].cpu(), want[k].detach().cpu()) for k in want))
    size = out.stat().st_size / 2**20
    print(f"wrote {out} (safetensors: {len(want)} tensors, {size:.1f} MiB, with architecture "
          f"{back['model_name']}, {len(back['class_names'])} classes, {back['img_size'] or '?'} px); loads "
          f"with no code run on any PyTorch: --weights {out}")
    if not same:
        print(f"reading {out} back gave other tensors than the model's; do not use it")
        return 1
    print("check: read back, every tensor identical to the checkpoint's")
    return 0
