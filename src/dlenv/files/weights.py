"""Weights files from elsewhere: what loads without consent, what needs --trust-pickle, and the raw
safetensors reader and writer.

pickle (`.pth`, `.pt`, anything but .safetensors)
    A pickle can run code when it is loaded, and torch.load(weights_only=True), which restricts what it
    rebuilds, could itself be beaten before PyTorch 2.10 (the default profile runs 1.13.1). So torch.load
    never sees the file: dlenv.files.torchfile reads it through torch's own zip reader, dlenv.files.pickleguard plays
    its opcodes against an allowlist (the tensors, storages, OrderedDicts and plain data a state dict or a
    dlenv checkpoint is made of, every tensor inside the bytes the file holds for it) and builds the
    tensors from the very bytes it judged. Such a file loads on any PyTorch, from anywhere, without a
    sidecar or a key: dlenv's own last.pth and best_model.pth, copied anywhere, and the plain state dicts
    torchvision, timm and `torch.save(model.state_dict())` write.
    Anything else stops before the first byte is unpickled, with one line naming what the file holds,
    unless the user consents for this one command with --trust-pickle (never from a YAML file): then
    torch.load(weights_only=True) reads it, and refuses arbitrary objects itself. A file made to be read
    two ways or built as pickle never writes (pickleguard.Forged), or one whose reading would take work
    without bound (pickleguard.Unbounded: shared containers, keys that hash alike, deep nesting), is
    refused even then. Only a file cut short is called "truncated or corrupt" (pickleguard.Damaged).

safetensors (`*.safetensors`)
    A JSON header of names, dtypes and shapes, then raw tensor bytes: reading it runs no code, on any
    PyTorch. `read_safetensors` returns its tensors and string metadata; dlenv.files.runstate decides whether
    the metadata describes a dlenv model and bounds every number in it.

Consent is a `LoadPolicy` passed to each load, from the command's options: nothing global.
Every file is opened through dlenv.files.safeio: regular files only, so a folder or a FIFO named x.pth is one
line, not a hang. No torch import at module level: the CLI imports this module for --help.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, check_stop, first_line, printable
from dlenv.files import pickleguard, safeio, torchfile
from dlenv.files.atomic import write_atomic

SUFFIX = ".safetensors"


# ---------------------------------------------------------------------------------------------------
# Consent


@dataclass(frozen=True)
class LoadPolicy:
    """How far a load may go: `trust_pickle` hands a pickle the allowlist refuses to
    torch.load(weights_only=True) (the user vouched for its source on the command line)."""

    trust_pickle: bool = False

    @classmethod
    def of(cls, cfg: Any) -> LoadPolicy:
        """The policy a command's options ask for (`trust_pickle` as typed: `command_line_consent`)."""
        return cls(trust_pickle=getattr(cfg, "trust_pickle", False) is True)


#: the policy that needs no consent: files the allowlist passes, and safetensors
SAFE = LoadPolicy()


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
# Loading


def is_safetensors(path: str | Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


def refusal(path: Path, reason: str) -> str:
    """The one line that stops a pickle the allowlist does not pass."""
    from dlenv import compat

    loader = ("its weights_only loader refuses arbitrary objects" if compat.WEIGHTS_ONLY_TRUSTED else
              "and before PyTorch 2.10 its weights_only loader can be made to run code by a crafted file "
              "(CVE-2025-32434, CVE-2026-24747)")
    return (f"refusing to unpickle {printable(str(path))}: it holds more than tensors and plain data ({reason}); "
            f"nothing in it was run. A state dict saved with torch.save(model.state_dict()) or a .safetensors "
            f"file loads as it is (docs/weights.md); pass --trust-pickle only if you trust where this file "
            f"came from ({loader})")


def load(path: str | Path, policy: LoadPolicy) -> Any:
    """The contents of a pickled weights file, on the CPU: judged and built by dlenv.files.torchfile from the
    bytes torch's reader gives, never by torch.load. A file the allowlist refuses is read by
    torch.load(weights_only=True) only under `policy.trust_pickle`; a forged or damaged one never.
    (A .safetensors path is `read_safetensors`'s.)

    Raises UserError for a path that is not a regular file and for a refused or damaged file; torch.load's
    own errors (an unknown global under --trust-pickle) propagate to the caller.
    """
    from dlenv import compat

    path = Path(path)
    shown = printable(str(path))
    with safeio.open_regular(path, "weights file") as fh:
        try:
            return torchfile.load(fh)
        except pickleguard.Damaged as e:
            check_stop()  # a stop signal torch's reader turned into an error of its own is not damage
            raise UserError(f"{shown} is truncated or corrupt ({e}); nothing in it was run. Use another copy "
                            "(a download or copy that did not finish?)") from None
        except pickleguard.Forged as e:
            raise UserError(f"refusing to unpickle {shown}: it is built in a way torch.save never writes ({e}); "
                            "nothing in it was run, and --trust-pickle does not open it. Get the weights again "
                            "from where they came from") from None
        except pickleguard.Unbounded as e:
            raise UserError(f"refusing to unpickle {shown}: reading it would take work without bound ({e}); "
                            "nothing in it was run, and --trust-pickle does not open it (torch.load would hang or "
                            "crash on it too). Get the weights again from where they came from, or as "
                            ".safetensors") from None
        except pickleguard.Refused as e:
            if not policy.trust_pickle:
                raise UserError(refusal(path, str(e))) from None
        fh.seek(0)
        return compat.load_weights_only(fh, map_location="cpu")


def read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors on the CPU, string metadata) of a .safetensors file. Raises UserError for a path that is
    not a regular file and for an unreadable file."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise UserError(f"{path}: reading .safetensors needs the safetensors package "
                        "(in requirements.txt: pip install -r requirements.txt)") from None
    safeio.open_regular(path, "weights file").close()  # a folder or a FIFO named x.safetensors: one line
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    except Exception as e:  # SafetensorError, OSError, a bad header: all mean "cannot read this file"
        first = first_line(e, 160, named=False)
        raise UserError(f"{printable(str(path))} is not a readable safetensors file ({printable(first)}); "
                        "export it again, or check that the download finished") from None
    return state, {str(k): str(v) for k, v in meta.items()}


# ---------------------------------------------------------------------------------------------------
# Writing


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write the tensors of `tensors` (other entries are skipped) with string `metadata` as .safetensors,
    atomically; returns the path."""
    import torch
    from safetensors.torch import save_file

    # own contiguous copies: safetensors refuses tensors that share memory (tied or viewed weights)
    own = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items() if torch.is_tensor(v)}
    return write_atomic(Path(path), lambda tmp: save_file(own, str(tmp), metadata=dict(metadata or {})))
