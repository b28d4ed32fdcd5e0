"""Pretrained weights: torchvision's and timm's, downloaded once into a cache that outlives the container.

`--pretrained` (the architecture's DEFAULT weights) or `--pretrained NAME` (IMAGENET1K_V2,
ResNet50_Weights.IMAGENET1K_V2; for timm a tag such as a1_in1k) picks the weights through the libraries'
own registries: torchvision's weights enums (`get_model_weights`) and timm's pretrained configs. Nothing
is ever downloaded without --pretrained.

Where the files go. torchvision's in `$TORCH_HOME/hub/checkpoints` (torch.hub's layout), timm's in
`$HF_HOME/hub` (Hugging Face's layout). Unset, they default to `.cache/torch` and `.cache/huggingface`
in the working folder: the mounted project (/root/workspace in the image), so a `docker run --rm`
downloads each file once, not once per container. Set TORCH_HOME / HF_HOME to share one cache between
projects.

Mirrors. DLENV_TORCHVISION_URL replaces https://download.pytorch.org/models (the file name is appended);
HF_ENDPOINT replaces https://huggingface.co for the hub (huggingface_hub reads it).

Checksums. torchvision's file names carry the first hex digits of the file's sha256
(resnet18-f37072fd.pth; torch.hub's check_hash); a Hugging Face LFS file is stored as a blob named by
its sha256. Each is checked after the download and again before each use; a mismatch is refused.

Offline (DLENV_OFFLINE=1, HF_HUB_OFFLINE=1, or no connection) and not cached: one line naming the file,
where it goes, and the command that fetches it on a machine with internet.

Trust. Every file is read through dlenv.files.weights like a --weights file: a torchvision .pth is a plain
state dict the pickle allowlist passes (no consent needed, from any host or mirror; an 8-digit hash
prefix is a check against corruption, not against a forger); timm's are safetensors where the hub has
them, which run no code.

No torch or timm import at module level. The --pretrained value is parsed in dlenv.options.values.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import urllib.error
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlenv.errors import UserError, optional_import, printable
from dlenv.model import hubcache
from dlenv.options.values import parse_pretrained

if TYPE_CHECKING:  # weights imports torch: the annotation only
    from dlenv.files import weights

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm/"
TORCHVISION_HOST = "https://download.pytorch.org/models"
MIRROR_ENV = "DLENV_TORCHVISION_URL"
OFFLINE_ENV = "DLENV_OFFLINE"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the resampling modes the input pipeline applies (torchvision's transforms and grid_sample both have them)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
_HASH = re.compile(r"-([a-f0-9]{8,64})\.")
#: create_model arguments by which timm would fetch or read weights itself
_TIMM_WEIGHTS_ARGS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir")


def is_timm(name: Any) -> bool:
    """Whether a --model value names a timm model: timm/<arch>."""
    return isinstance(name, str) and name.startswith(TIMM_PREFIX)


def timm_arch(name: str) -> str:
    return name[len(TIMM_PREFIX):]


# ---------------------------------------------------------------------------------------------------
# Where files live


def _project_cache(kind: str) -> Path:
    return Path.cwd() / ".cache" / kind


def torch_home() -> Path:
    """$TORCH_HOME, else .cache/torch in the working folder (the mounted project)."""
    return Path(os.environ["TORCH_HOME"]).expanduser() if os.environ.get("TORCH_HOME") else _project_cache("torch")


def hf_cache() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else .cache/huggingface/hub in the working folder."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ["HF_HOME"]).expanduser() if os.environ.get("HF_HOME") else _project_cache("huggingface")
    return home / "hub"


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in (OFFLINE_ENV, "HF_HUB_OFFLINE"))


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------------
# Which weights: resolved from the libraries' registries, no network


@dataclass(frozen=True)
class Weights:
    """One set of pretrained weights and what fine-tuning needs from it (plain values, for config.yaml)."""

    model: str                  # the --model value: resnet50, timm/convnext_atto
    name: str                   # ResNet50_Weights.IMAGENET1K_V2, timm/convnext_atto.d2_in1k
    source: str                 # "torchvision" or "timm"
    file: str                   # the file name in the cache
    url: str                    # where it is fetched from (a mirror applied)
    num_classes: int            # of the pretrained head
    img_size: int               # the input size the weights were trained or evaluated at
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    interpolation: str = "bilinear"
    hash_prefix: str | None = None      # torchvision: the sha256 prefix in the file name
    repo: str | None = None             # timm: the hub repository (timm/convnext_atto.d2_in1k)
    classifier: tuple[str, ...] = field(default_factory=tuple)  # timm: the head's module names

    def record(self) -> dict[str, Any]:
        """What config.yaml notes: the weights and the preprocessing they bring."""
        return {"weights": self.name, "source": self.source, "file": self.file, "url": self.url,
                "img_size": self.img_size, "mean": list(self.mean), "std": list(self.std),
                "interpolation": self.interpolation}


def resolve(model: str, pretrained: str) -> Weights:
    """The weights `--pretrained` names for `--model` (no network). Raises UserError for a model that has
    no pretrained weights or a weights name it does not have, listing the ones it has."""
    return _resolve_timm(model, pretrained) if is_timm(model) else _resolve_torchvision(model, pretrained)


def _resolve_torchvision(model: str, pretrained: str) -> Any:
    from torchvision import models as tvm

    try:
        enum = tvm.get_model_weights(model)
    except (ValueError, KeyError):
        raise UserError(f"--pretrained: torchvision has no weights for --model {model!r}; list the models with "
                        "python -c \"import torchvision; print(torchvision.models.list_models())\"") from None
    names = [w.name for w in enum]
    want = pretrained.split(".")[-1]
    if want.upper() == "DEFAULT":
        w = enum.DEFAULT
    elif want in names or want.upper() in names:
        w = enum[want if want in names else want.upper()]
    else:
        raise UserError(f"--pretrained {pretrained}: {model} has no such weights; it has {', '.join(names)} "
                        "(or DEFAULT)")
    tf = w.transforms()
    crop = tf.crop_size[0] if isinstance(tf.crop_size, (list, tuple)) else int(tf.crop_size)
    file = w.url.rsplit("/", 1)[-1]
    prefix = _HASH.search(file)
    return Weights(model=model, name=f"{type(w).__name__}.{w.name}", source="torchvision", file=file,
                   url=f"{torchvision_base()}/{file}", num_classes=len(w.meta["categories"]), img_size=int(crop),
                   mean=tuple(float(x) for x in tf.mean), std=tuple(float(x) for x in tf.std),
                   interpolation=interpolation(tf.interpolation.value), hash_prefix=prefix.group(1) if prefix else None)


#: what urllib (torch.hub's downloader) opens; anything else in DLENV_TORCHVISION_URL was its ValueError
_MIRROR_SCHEMES = ("http", "https", "ftp", "file")


def torchvision_base() -> str:
    """torchvision's download folder, or the mirror DLENV_TORCHVISION_URL names. UserError when that is no
    URL urllib can open."""
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        try:
            scheme = urllib.parse.urlsplit(mirror).scheme
        except ValueError:  # "http://[::1": an unclosed IPv6 bracket
            scheme = ""
        if scheme.lower() not in _MIRROR_SCHEMES:
            raise UserError(f"{MIRROR_ENV}={printable(mirror)[:120]} is not a URL of a mirror; set it to the folder "
                            f"that holds torchvision's files (e.g. https://mirror.example/models) or unset it")
    return (mirror or TORCHVISION_HOST).rstrip("/")


def _resolve_timm(model: str, pretrained: str) -> Weights:
    timm = _import_timm(model)
    arch = timm_arch(model)
    base, tag = timm.models.split_model_name_tag(arch)
    if not timm.is_model(base):
        close = timm.list_models(f"*{base[:6]}*")[:5]
        hint = f"; close: {', '.join(close)}" if close else "; list them with timm.list_models()"
        raise UserError(f"--model {model}: timm has no model {base!r}{hint}")
    if pretrained.upper() != "DEFAULT":
        if tag and tag != pretrained:
            raise UserError(f"--model {model} --pretrained {pretrained}: two tags; give one")
        tag = pretrained
    full = f"{base}.{tag}" if tag else base
    try:
        cfg = timm.models.get_pretrained_cfg(full, allow_unregistered=True)
    except RuntimeError:  # a tag the architecture does not have
        cfg = None
    tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{base}.*")]
    if cfg is None or not getattr(cfg, "hf_hub_id", None):
        have = f"it has {', '.join(tags)}" if tags else "timm has no pretrained weights for it"
        raise UserError(f"--pretrained {pretrained}: no hub weights for timm/{full}; {have}")
    classifier = cfg.classifier if isinstance(cfg.classifier, (list, tuple)) else (cfg.classifier,)
    repo = cfg.hf_hub_id
    file = getattr(cfg, "hf_hub_filename", None) or "model.safetensors"
    return Weights(model=model, name=f"timm/{repo.split('/', 1)[-1]}", source="timm", file=file,
                   url=f"{hf_endpoint()}/{repo}/resolve/main/{file}", num_classes=int(cfg.num_classes),
                   img_size=int(cfg.input_size[-1]), mean=tuple(float(x) for x in cfg.mean),
                   std=tuple(float(x) for x in cfg.std), interpolation=interpolation(cfg.interpolation),
                   repo=repo, classifier=tuple(c for c in classifier if c))


def interpolation(value: Any) -> str:
    """The resampling a weights record names, as one of INTERPOLATIONS: torchvision's InterpolationMode
    values and timm's `interpolation` strings are these names already; lanczos and hamming (sharper
    filters no GPU kernel has) become bicubic, anything else (timm's 'random', none) bilinear."""
    s = str(getattr(value, "value", value) or "").strip().lower()
    if s in INTERPOLATIONS:
        return s
    return "bicubic" if s in ("lanczos", "hamming") else "bilinear"


def _weights_of(run_file: Any) -> Weights | None:
    """The --pretrained weights the run of a dlenv run file started from, looked up in the libraries'
    registries from the names its config holds (nothing is fetched); None without them, or when the names
    no longer resolve (val then says nothing it cannot stand behind)."""
    config = run_file.get("config") if isinstance(run_file, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("pretrained"), str):
        return None
    try:
        return resolve(config.get("model"), parse_pretrained(config["pretrained"]) or "")
    except (UserError, ValueError, TypeError, AttributeError):
        return None


def norm_of(run_file: Any) -> tuple[tuple, tuple] | None:
    """(mean, std) the run of a dlenv run file normalized by: its --pretrained weights' own, else None
    (ImageNet's)."""
    w = _weights_of(run_file)
    return (tuple(w.mean), tuple(w.std)) if w else None


def interpolation_of(run_file: Any) -> str:
    """The resampling the run of a dlenv run file resized with: its --pretrained weights' own, else bilinear."""
    w = _weights_of(run_file)
    return w.interpolation if w else "bilinear"


def hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _import_timm(model: str) -> Any:
    missing = f"--model {model} needs timm (in requirements.txt): pip install -r requirements.txt"
    optional_import("timm.models", missing)  # a timm built for another NumPy or torch: one line and pip check
    return optional_import("timm", missing)


def timm_fixed_size(model: str) -> bool:
    """Whether a timm architecture's input size is built into it (a ViT's position embedding)."""
    timm = _import_timm(model)
    cfg = timm.models.get_pretrained_cfg(timm.models.split_model_name_tag(timm_arch(model))[0])
    return bool(cfg is not None and getattr(cfg, "fixed_input_size", False))


def timm_args(model: str, model_args: dict[str, Any], img_size: int | None) -> dict[str, Any]:
    """create_model's keyword arguments besides num_classes: `model_args` (--model-args), with img_size when
    the architecture's input size is built into it (`timm_fixed_size`) and a size is given."""
    if img_size is not None and timm_fixed_size(model):
        return {**model_args, "img_size": int(img_size)}
    return dict(model_args)


def timm_model(model: str, num_classes: int, state: dict[str, Any] | None, kwargs: dict[str, Any]) -> Any:
    """timm's `create_model(arch, num_classes=..., **kwargs)`; with `state` (fetched by `fetch`, read by
    `fetched_state_dict`) it goes through timm's own pretrained loading (its filters, e.g. a ViT's position
    embedding resized to img_size; the classifier dropped when the class count differs). Never
    downloads: timm is handed the state dict. Raises UserError for an unknown name or bad arguments."""
    timm = _import_timm(model)
    arch = timm_arch(model)
    if not timm.is_model(timm.models.split_model_name_tag(arch)[0]):
        close = timm.list_models(f"*{arch[:5]}*")[:5]
        raise UserError(f"--model {model}: timm has no model {arch!r}" + (f"; close: {', '.join(close)}" if close else
                                                                         "; list them with timm.list_models()"))
    own = [k for k in kwargs if k in _TIMM_WEIGHTS_ARGS]
    if own:  # timm would fetch or read files itself, past the cache, the checksums and dlenv.files.weights
        raise UserError(f"--model {model} --model-args {own[0]}=...: dlenv loads timm's weights itself; use "
                        "--pretrained [TAG] (or --weights FILE)")
    extra = {"pretrained": True, "pretrained_cfg_overlay": {"state_dict": state}} if state is not None else {}
    try:
        net = timm.create_model(arch, num_classes=num_classes, **extra, **kwargs)
    except TypeError as e:
        raise UserError(f"--model {model} --model-args: {e}") from None
    except RuntimeError as e:  # a state dict that does not fit (strict load)
        if state is None:
            raise
        raise UserError(f"--pretrained: the weights do not fit timm's {arch} "
                        f"({str(e).strip().splitlines()[0][:160]})") from None
    if state is not None:  # timm drops a head of another class count silently: say so, as for torchvision
        own = net.state_dict()
        head = [k for k, v in state.items() if k in own and getattr(v, "shape", None) != own[k].shape]
        if head:
            log.warning("--pretrained %s: head %s has %d classes, the data has %d; it starts fresh (fine-tuning)",
                        arch, ", ".join(head), state[head[0]].shape[0], num_classes)
    return net


# ---------------------------------------------------------------------------------------------------
# Fetching: at most once, checked


def fetch(w: Weights, progress: bool = True) -> Path:
    """The weights' file in the cache, downloaded first if it is not there (with a progress bar).

    Raises UserError (one line) when it is not cached and cannot be fetched, or when its checksum
    does not match."""
    return _fetch_torchvision(w, progress) if w.source == "torchvision" else _fetch_hub(w, progress)


def _fetch_torchvision(w: Weights, progress: bool) -> Path:
    import torch.hub

    folder = torch_home() / "hub" / "checkpoints"
    dest = folder / w.file
    if dest.is_file():
        _check_prefix(dest, w)
        return dest
    if _offline():
        raise UserError(_not_cached(w, dest, "offline: " + OFFLINE_ENV + " or HF_HUB_OFFLINE is set"))
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{w.file}.{os.getpid()}.judge"
    try:
        # torch.hub's own downloader (a tqdm bar, the hash prefix checked), into a name of our own: the
        # file is judged like any --weights file before it is moved into the cache, so a forged file
        # served by a mirror never lands there (the 8-digit prefix is no proof: a forger matches it)
        _say_download(w.url, dest)
        with warnings.catch_warnings():
            # torch.hub's downloader leaves its HTTP response to the garbage collector (1.13 to 2.14): an
            # "unclosed socket" ResourceWarning later, somewhere else. Collected here, where it is known.
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                torch.hub.download_url_to_file(w.url, str(part), hash_prefix=w.hash_prefix, progress=progress)
            finally:
                gc.collect()
        _judge(part, w)
        _readable(part)
        os.replace(part, dest)
    except RuntimeError as e:
        if "invalid hash value" in str(e):
            raise UserError(f"{w.url} does not match its checksum (sha256 should start {w.hash_prefix}); "
                            "refusing it, nothing was saved. Check the mirror (" + MIRROR_ENV + ") or try again"
                            ) from None
        raise
    except urllib.error.HTTPError as e:  # the server answered: it is there, the file is not
        raise UserError(f"--pretrained: {w.url} answered {e.code} {e.reason}: "
                        + ("the mirror (" + MIRROR_ENV + ") does not have " + w.file + "; copy it there or unset "
                           + MIRROR_ENV if os.environ.get(MIRROR_ENV) else "try again later") + "; nothing was saved"
                        ) from None
    except OSError as e:  # URLError, connection refused, DNS: all mean "cannot reach it"
        raise UserError(_not_cached(w, dest, hubcache.reason(e))) from None
    finally:
        part.unlink(missing_ok=True)
    return dest


def _say_download(url: str, dest: Path) -> None:
    """One line before a download, so that a log without a progress bar still shows what happened."""
    print(f"--pretrained: downloading {url} into {_shown(dest.parent)}/", file=sys.stderr, flush=True)


def _readable(path: Path) -> None:
    """The mode a new file gets from the umask: torch.hub's temporary file is 0600, and a cache shared
    by a team (TORCH_HOME) would be unreadable to the others."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _judge(path: Path, w: Weights) -> None:
    """Refuse a downloaded .pth the allowlist does not pass (UserError naming the URL), building nothing."""
    from dlenv.files import pickleguard, safeio, torchfile

    with safeio.open_regular(path, "weights file") as fh:
        try:
            torchfile.check(fh)
        except pickleguard.Refused as e:
            raise UserError(f"refusing to unpickle {w.url}: it is not the plain state dict torchvision serves "
                            f"({e}); nothing in it was run and nothing was saved. Check the mirror "
                            f"({MIRROR_ENV})") from None


def _check_prefix(path: Path, w: Weights) -> None:
    if w.hash_prefix and not hubcache.sha256_of(path).startswith(w.hash_prefix):
        raise UserError(f"{_shown(path)} does not match its checksum (sha256 should start {w.hash_prefix}): "
                        "it is corrupt or was changed; delete it and run again to download it anew")


def _not_cached(w: Weights, dest: Path, why: str) -> str:
    if w.source == "torchvision":
        return (f"--pretrained: {w.file} is not in {_shown(dest.parent)}/ and {w.url} cannot be reached ({why}); "
                f"where there is internet run `curl -L -o {w.file} {w.url}` and copy {w.file} into "
                f"{_shown(dest.parent)}/ (or set TORCH_HOME to a cache that has it, or {MIRROR_ENV} to a mirror)")
    return (f"--pretrained: {w.repo}/{w.file} is not in {_shown(dest)}/ and {hf_endpoint()} cannot be reached "
            f"({why}); where there is internet run `HF_HOME=hf hf download {w.repo} {w.file}` and copy "
            f"hf/hub/ to {_shown(dest)}/ (or set HF_HOME to a cache that has it, or HF_ENDPOINT to a mirror)")


def _fetch_hub(w: Weights, progress: bool) -> Path:
    import huggingface_hub as hub
    from huggingface_hub import utils as hub_utils

    cache = hf_cache()
    # a cached file is used without asking the hub: a cache hit makes no request at all
    found = hub.try_to_load_from_cache(w.repo, w.file, cache_dir=str(cache))
    if isinstance(found, str):
        path = Path(found)
    else:
        if _offline():
            raise UserError(_not_cached(w, cache, "offline: " + OFFLINE_ENV + " or HF_HUB_OFFLINE is set"))
        if not progress:
            hub_utils.disable_progress_bars()
        why = hubcache.unreachable(hf_endpoint())
        if why:
            raise UserError(_not_cached(w, cache, why))
        _say_download(f"{hf_endpoint()}/{w.repo}/{w.file}", cache / "hub")
        try:
            path = Path(hub.hf_hub_download(w.repo, w.file, cache_dir=str(cache), endpoint=hf_endpoint()))
        except hub_utils.LocalEntryNotFoundError as e:  # a subclass of EntryNotFoundError: the hub was not reached
            raise UserError(_not_cached(w, cache, hubcache.reason(e))) from None
        except hub_utils.EntryNotFoundError:
            raise UserError(f"--pretrained: {w.repo} on {hf_endpoint()} has no {w.file}") from None
        except hub_utils.RepositoryNotFoundError:
            raise UserError(f"--pretrained: {hf_endpoint()} has no repository {w.repo} (or it needs a login: "
                            "HF_TOKEN)") from None
        except OSError as e:
            raise UserError(_not_cached(w, cache, hubcache.reason(e))) from None
        hubcache.record(path, cache)
    hubcache.check_blob(path, cache, f"{_shown(path)} ({w.repo})")
    return path


# ---------------------------------------------------------------------------------------------------
# Loading: through dlenv.files.weights' safe path


def fetched_state_dict(w: Weights, path: Path, policy: weights.LoadPolicy | None = None) -> dict[str, Any]:
    """The state dict in the file `fetch` gave for `w`, read through dlenv.files.weights' checks like any
    --weights file (`policy`: what --trust-pickle allows; None: the allowlist only). Raises UserError for a
    refused or unreadable file."""
    from dlenv.errors import first_line
    from dlenv.files import weights

    try:
        if weights.is_safetensors(path):
            obj = weights.read_safetensors(path)[0]
        else:
            obj = weights.read(path, policy or weights.SAFE)[0]
    except UserError:
        raise
    except Exception as e:  # the loader failed on these bytes although their checksum matched
        raise UserError(f"{_shown(path)} ({w.name}) cannot be read ({first_line(e)}); delete it and run again"
                        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not (isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj)):
        raise UserError(f"{_shown(path)} ({w.name}) holds no state dict; delete it and run again")
    return dict(obj)
