"""Weights files from elsewhere: what loads without consent, what needs --trust-pickle, and the raw
safetensors reader and writer.

pickle (`.pth`, `.pt`, anything but .safetensors)
    A pickle can run code when it is loaded, and torch.load(weights_only=True), which restricts what it
    rebuilds, could itself be beaten before PyTorch 2.10 (the default profile runs 1.13.1). So torch.load
    never sees the file: dlenv.files.torchfile reads it through torch's own zip reader, dlenv.files.pickleguard plays
    its opcodes against an allowlist (the tensors, storages, OrderedDicts and plain data a state dict or a
    dlenv run file is made of, every tensor inside the bytes the file holds for it) and builds the
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

`read(path, policy)` is the one way in: it says what a path is when it is no weights file at all (a
folder, a FIFO, an empty file, a CSV, a TorchScript export) and reads a .safetensors or a pickle, as
stored. A run file's format (its tag, dlenv's float encoding, the description a .safetensors run file
keeps as metadata) is dlenv.files.runstate's: `runstate.load_state` is this read, decoded and checked.
The state-dict helpers that put weights into a model are dlenv.model.statedict's.

Consent is a `LoadPolicy` passed to each read, from the command's options: nothing global (the rule that
only the command line consents is dlenv.options.declare.command_line_consent's). Every file is opened
through dlenv.files.safeio: regular files only, so a folder or a FIFO named x.pth is one line, not a hang.
No torch import at module level: a command's module imports LoadPolicy before PyTorch loads.
"""

from __future__ import annotations

import errno
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from dlenv.errors import UserError, check_stop, cut_at_word, first_line, optional_import, printable, with_path
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
        """The policy a command's options ask for (`trust_pickle` as typed on the command line:
        dlenv.options.declare.command_line_consent)."""
        return cls(trust_pickle=getattr(cfg, "trust_pickle", False) is True)


#: the policy that needs no consent: files the allowlist passes, and safetensors
SAFE = LoadPolicy()



# ---------------------------------------------------------------------------------------------------
# Loading


#: what `sniff` calls a TorchScript export
TORCHSCRIPT = "a TorchScript model (an export)"


class TorchScriptExport(UserError):
    """`read`'s refusal of a TorchScript export: a program, not weights (dlenv.runfolder.trained opens one
    for the commands that take it, with consent)."""


def is_safetensors(path: str | Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


def refusal(shown: str, reason: str) -> str:
    """The one line that stops a pickle the allowlist does not pass (`shown`: the file's path, printable)."""
    from dlenv import compat

    loader = ("its weights_only loader refuses arbitrary objects" if compat.WEIGHTS_ONLY_TRUSTED else
              "and before PyTorch 2.10 its weights_only loader can be made to run code by a crafted file "
              "(CVE-2025-32434, CVE-2026-24747)")
    return (f"refusing to unpickle {shown}: it holds more than tensors and plain data ({reason}); "
            f"nothing in it was run. A state dict saved with torch.save(model.state_dict()) or a .safetensors "
            f"file loads as it is (docs/weights.md); pass --trust-pickle only if you trust where this file "
            f"came from ({loader})")


def read(path: str | Path, policy: LoadPolicy = SAFE) -> tuple[Any, dict[str, str]]:
    """(what the weights file at `path` holds, on the CPU, as stored; its string metadata): a pickle's
    object as built, with no metadata ({}); a .safetensors file's tensors and metadata
    (`read_safetensors`). dlenv.files.runstate.load_state decodes a run file from these. `policy`: what
    --trust-pickle allows. The file is opened once, as a regular file, and read from that descriptor.

    Raises UserError naming the file for a missing file, one that is not a PyTorch file at all (a
    folder, a FIFO, an empty file, a CSV, YAML or other text, a zip of something else, a TorchScript
    export), a truncated, corrupt or unsafe one; OSError (with the path) when the disk or the system
    fails rather than the file.
    """
    path = Path(path)
    shown = printable(str(path))
    if not path.exists():
        raise UserError(f"weights file {shown} not found; pass the path of a .pth file (e.g. runs/exp/last.pth)")
    if path.is_dir():
        raise UserError(f"{shown} is a folder, not a PyTorch weights file; pass the .pth file inside it "
                        f"(e.g. {printable(str(path / 'best_model.pth'))})")
    safetensors = is_safetensors(path)
    try:
        # a FIFO would block a plain open() until a writer comes; a device or /proc/self/mem: one line
        with safeio.open_regular(path, "weights file") as fh:
            what = None if safetensors else sniff(fh)
            if what:
                refused = TorchScriptExport if what[0] == TORCHSCRIPT else UserError
                raise refused(f"{shown} is {what[0]}, not a PyTorch weights file; "
                              + (what[1] or "pass a .pth file written by torch.save (e.g. runs/exp/best_model.pth)"))
            if safetensors:
                return _safetensors(path, shown)
            return _load_pickle(fh, shown, policy), {}
    except UserError:  # this module's own lines: not a weights file, a refused, forged or damaged one
        raise
    except pickle.UnpicklingError as e:
        # weights_only (under --trust-pickle) refuses any global it does not know: the file wants to run
        # code or rebuild arbitrary objects. Nothing from it was executed.
        reason = cut_at_word(str(e).strip().splitlines()[-1], 160) if str(e).strip() else "unsupported object"
        raise UserError(f"refusing to load {shown}: it is not a plain-weights file ({reason}); "
                        "nothing in it was run. Re-save it as a state dict with torch.save(model.state_dict())"
                        ) from None
    except Exception as e:  # any other failure of the loader on these bytes: the file is what's wrong
        if isinstance(e, OSError) and e.errno in (errno.EIO, errno.EACCES, errno.EPERM, errno.EMFILE):
            raise with_path(e, path) from None  # the disk or the system, not the file: the CLI says so
        # torch's reader failing on these bytes: not known to be cut short (pickleguard.Damaged says that),
        # so not called "truncated"
        raise UserError(f"weights file {shown} could not be read ({first_line(e, 160, named=False)}): it is "
                        "damaged or not a file torch.save wrote; use another run file (last.pth and best_model.pth "
                        "are written atomically)") from None


def sniff(fh: BinaryIO) -> tuple[str, str | None] | None:
    """(what the open file `fh` is, what to do or None) when its first bytes say it is certainly not a
    pickled weights file, else None; `fh` is back at its start."""
    head = fh.read(512)
    fh.seek(0)
    if not head:
        return "an empty file (0 bytes)", "a copy or download that did not finish? Use another weights file"
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip format: an archive/data.pkl inside
        try:
            with zipfile.ZipFile(fh) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, ValueError, OSError):
            return None  # a cut-off zip: the reader says what is missing
        finally:
            fh.seek(0)
        if any(n.endswith("constants.pkl") for n in names):
            return TORCHSCRIPT, "pass the .pth run file it was exported from"
        if not any(n.endswith("data.pkl") for n in names):
            return f"a zip archive of {len(names)} file(s) ({', '.join(names[:3])})", None
        return None
    if head[:1] == b"\x80" or head[8:10] == b'{"':  # a pickle (torch's legacy format) or safetensors
        return None
    if b"\0" not in head:
        text = head.decode("utf-8", errors="replace")
        if text.lstrip().startswith("epoch,"):
            return "a results.csv (the per-epoch table of a run)", None
        first = text.strip().splitlines()[0][:40] if text.strip() else ""
        return f"a text file (it starts {first!r})", None
    return f"another kind of file (it starts with bytes {head[:4].hex(' ')})", None


def _load_pickle(fh: BinaryIO, shown: str, policy: LoadPolicy) -> Any:
    """The contents of the pickled weights file open as `fh` (`shown`: its path, printable), on the CPU: judged
    and built by dlenv.files.torchfile from the bytes torch's reader gives, never by torch.load. A file the
    allowlist refuses is read by torch.load(weights_only=True) only under `policy.trust_pickle`; a forged or
    damaged one never.

    Raises UserError for a refused or damaged file; torch.load's own errors (an unknown global under
    --trust-pickle) propagate to `read`, which names them.
    """
    from dlenv import compat  # imports torch: not on the CLI's path

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
            raise UserError(refusal(shown, str(e))) from None
    fh.seek(0)
    return compat.load_weights_only(fh, map_location="cpu")


def read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors on the CPU, string metadata) of a .safetensors file. Raises UserError for a path that is
    not a regular file and for an unreadable file."""
    safeio.open_regular(path, "weights file").close()  # a folder or a FIFO named x.safetensors: one line
    return _safetensors(path, printable(str(path)))


def _safetensors(path: Path, shown: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`read_safetensors` of a path known to be a regular file (safetensors opens it by name)."""
    safe_open = optional_import("safetensors", f"{shown}: reading .safetensors needs the safetensors package (in "
                                "requirements.txt: pip install -r requirements.txt)").safe_open
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    except Exception as e:  # SafetensorError, OSError, a bad header: all mean "cannot read this file"
        first = first_line(e, 160, named=False)
        raise UserError(f"{shown} is not a readable safetensors file ({printable(first)}); "
                        "export it again, or check that the download finished") from None
    return state, {str(k): str(v) for k, v in meta.items()}


# ---------------------------------------------------------------------------------------------------
# Writing


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write the tensors of `tensors` (other entries are skipped) with string `metadata` as .safetensors,
    atomically; returns the path."""
    import torch

    save_file = optional_import("safetensors.torch", "writing .safetensors needs the safetensors package (in "
                                "requirements.txt: pip install -r requirements.txt)").save_file

    # own contiguous copies: safetensors refuses tensors that share memory (tied or viewed weights)
    own = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items() if torch.is_tensor(v)}
    return write_atomic(Path(path), lambda tmp: save_file(own, str(tmp), metadata=dict(metadata or {})))
