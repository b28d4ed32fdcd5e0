"""Every option of every dlenv command, declared once.

Each command's options are the fields of one frozen dataclass here (name, type, default, help). The
CLI (`dlenv.cli`) and the invoke tasks (`dlenv.tasks`) are both generated from these classes, so a
flag is added, renamed or documented in exactly one place. A config is built as

    defaults  <  optional YAML file (`--cfg`)  <  flags given

by `build()`, which parses strings, checks choices and ranges, and refuses unknown keys with the list
of valid ones. `to_dict()` gives plain types for config.yaml and run files.

This module must not import torch: `dlenv --help` and `invoke --list` import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlenv import archives
from dlenv.errors import UserError
from dlenv.options.bench_options import BenchMemoryConfig
from dlenv.options.cfgfile import options_in
from dlenv.options.declare import (  # noqa: F401 (BATCH_MAX, IMG_SIZE_MAX: config's bounds, as tests read them)
    BATCH_MAX,
    BATCH_WHY,
    DEVICE_HELP,
    EPOCHS_MAX,
    EPOCHS_WHY,
    IMG_SIZE_MAX,
    IMG_WHY,
    decode_overlap,
    flag,  # noqa: F401 (config.flag: the spelling of an option on the command line)
    image_channels,
    normalize_option,
    opt,
    parse_option,
    resize_option,
    trust_pickle,
    workers_here,
)
from dlenv.options.predict_options import PredictConfig
from dlenv.options.runs_options import PlotConfig, RunsConfig
from dlenv.options.server_options import LabConfig, MlflowConfig, TensorboardConfig
from dlenv.options.values import (
    auto_float,
    auto_int,
    batch_or_auto,
    folder_name,
    int_list,
    model_args_text,
    on_off_auto,
    open_fraction,
    parse_bool,
    parse_float,
    parse_int,
    parse_pretrained,
    parse_str,
    ratio_or_auto,
    scale_range_or_auto,
    workers_or_auto,
)
from dlenv.options.watch_options import WatchConfig

# Value parsers (dlenv.options.values): each takes the string a user typed (or a YAML value) and returns the
# typed value, raising ValueError with a short reason.
_bool, _int, _float, _str = parse_bool, parse_int, parse_float, parse_str


# ---------------------------------------------------------------------------------------------------
# The commands' options.

#: the largest --seed: torch, NumPy and the samplers take 64-bit seeds, and each rank adds its number
SEED_MAX = 2**63 - 1
#: the optimizers `--optimizer` names besides auto, the one list of them: dlenv.engine.optim gives each its
#: defaults and builds it (for the run and for a memory probe)
OPTIMIZERS = ("sgd", "adamw")
_DECODERS = ("auto", "pil", "cv2", "tvio", "nvjpeg", "nvimgcodec")
@dataclass(frozen=True)
class TrainConfig:
    """Options of `train`."""

    # data
    data: str | None = opt(None, "dataset folder (train/ and val/ of class folders, or class folders "
                                 "only); default: the one dataset under data/, else the built-in demo "
                                 "dataset", parse=_str)
    val_split: float = opt(0.2, "fraction held out for validation when the data has no val/ folder",
                           min=0.0, max=0.9)
    img_size: int | None = opt(None, "training image size in pixels, or auto (the default): the training "
                                     "images' typical size, capped for speed (the choice and its reason are "
                                     "printed); a pretrained model's own size wins", parse=auto_int, min=16,
                               max=IMG_SIZE_MAX, why=IMG_WHY)
    workers: int | str = opt("auto", "DataLoader worker processes: a number (at most 4 per CPU, or 64), or "
                                     "auto (from CPU count and /dev/shm)", parse=workers_or_auto, here=workers_here)
    bad_images: str = opt("skip", "an image that fails to decode: skip it (reported once) or stop the run",
                          choices=("skip", "error"))
    cache: str = opt("auto", "decode the dataset once to uint8 at a fixed size and augment on the GPU: on, "
                             "off, or auto (on when augmenting on the GPU for a dataset that decoded takes "
                             "under 1/16 of the GPU's memory, kept there, or under 2 GiB and 1/8 of free "
                             "memory)", parse=on_off_auto,
                     choices=("auto", "on", "off"), bare="on")
    cache_mode: str = opt("auto", "where --cache keeps the decoded images: gpu (in the GPU's memory), ram, "
                                  "disk (memory-mapped) or auto (gpu where they take under 1/16 of its memory)",
                          choices=("auto", "ram", "disk", "gpu"))
    cache_dir: str = opt(".dlenv-cache", "folder of --cache-mode disk files (reused while the data and "
                                         "--img-size are unchanged)")
    decoder: str = opt("auto", "JPEG decoder: auto (nvimgcodec on a GPU with JPEG engines; else nvjpeg "
                               "where torchvision batch-decodes and fewer than 8 workers would decode on "
                               "the CPU; either only while a decoded batch is small beside GPU memory; else "
                               "the fastest CPU one on a few files), pil, cv2, tvio (torchvision.io), nvjpeg "
                               "(on the GPU's SMs) or nvimgcodec (nvImageCodec, the GPU's JPEG engines)",
                       choices=_DECODERS)
    gpu_augment: str = opt("auto", "crop, flip and normalize uint8 batches on the GPU: auto (on when "
                                   "training on a GPU), on, or off (torchvision transforms in the workers)",
                           choices=("auto", "on", "off"))
    decode_overlap: str = decode_overlap()
    augment: str = opt("auto", "training augmentation: standard (random crops of 8-100% of the image, "
                               "any aspect 3:4-4:3, for photos), light (crops of 50-100%, near-square), none "
                               "(the whole image), or auto (standard; light for the demo data)",
                       choices=("auto", "standard", "light", "none"))
    hflip: str = opt("auto", "random horizontal flips in training: on, off, or auto (off where most class names "
                             "are single characters, as digits and letters, whose mirror image is another class "
                             "or none, as the dataset report says; else on)", parse=on_off_auto,
                     choices=("auto", "on", "off"), bare="on")
    crop_scale: tuple | str = opt("auto", "area range MIN,MAX of the random crops, as fractions of the image "
                                          "(e.g. 0.35,1), or auto: the --augment preset's",
                                  parse=scale_range_or_auto)
    synthetic: bool = opt(False, "random tensors already on the device instead of a dataset "
                                 "(for speed and memory measurements)")
    channels: int = image_channels()
    # model
    model: str = opt("auto", "a torchvision classification model name (resnet50, vit_b_16, ...), a timm "
                             "one (timm/convnext_atto), small_cnn (dlenv's own, for CPUs), or your own: "
                             "FILE.py:factory or package.module:factory (see docs/training.md); auto: "
                             "resnet18, or the CPU recipe on the demo data without a GPU")
    model_args: str | None = opt(None, "keyword arguments for your model's factory or timm's create_model: "
                                       "k=v,... (e.g. width=64,drop=0.1)", parse=model_args_text)
    weights: str | None = opt(None, "local state dict or run file (best_model.pth, last.pth) to start from, "
                                    ".safetensors or .pth (nothing is downloaded)", parse=_str)
    trust_pickle: bool = trust_pickle()
    pretrained: str | None = opt(None, "start from the model's pretrained weights: alone the architecture's "
                                       "default, or a name (IMAGENET1K_V2; a timm tag such as a1_in1k); "
                                       "downloaded once into .cache/ (TORCH_HOME, HF_HOME; docs/training.md)",
                                 parse=parse_pretrained, bare="DEFAULT")
    freeze_epochs: int = opt(0, "with --pretrained: train only the new head for this many epochs (the "
                                "backbone's BatchNorm statistics frozen), then the whole model", min=0,
                             max=EPOCHS_MAX, why=EPOCHS_WHY)
    backbone_lr: float = opt(0.1, "with --pretrained: the backbone's learning rate as a fraction of --lr "
                                  "(the new head gets --lr)", min=0.0, max=1.0)
    checkpoint: bool = opt(False, "activation checkpointing of the model's repeated blocks "
                                  "(less memory, some more compute)")
    checkpoint_ratio: float | str = opt("auto", "fraction of the repeated blocks that --checkpoint recomputes, "
                                                "or auto: on a GPU the fewest that let the batch fit (probed "
                                                "there; every block with --batch-size auto), on a CPU none "
                                                "(recomputing costs time to save memory a CPU rarely lacks)",
                                        parse=ratio_or_auto)
    channels_last: bool = opt(True, "channels_last memory format for convolutional models on CUDA")
    compile: str = opt("auto", "torch.compile the model: on, off, or auto (on for a CUDA run of PyTorch 2.x "
                               "long enough to repay the compile time; the rule is in config.yaml)",
                       parse=on_off_auto, choices=("auto", "on", "off"), bare="on")
    sync_bn: bool = opt(False, "synchronized BatchNorm across GPUs (with --gpus > 1)")
    # precision and batch
    amp: bool = opt(False, "automatic mixed precision")
    amp_dtype: str = opt("auto", "AMP dtype: auto (bf16 where supported, else fp16), fp16 or bf16",
                         choices=("auto", "fp16", "bf16"))
    batch_size: int | str = opt(32, "micro-batch per GPU (at most 2^20); auto: the one that trains fastest per "
                                    "image among those that fit; max: the largest that fits",
                                parse=batch_or_auto, max=BATCH_MAX, why=BATCH_WHY)
    accum_steps: int = opt(1, "micro-batches per optimizer step (gradient accumulation)", min=1,
                           max=BATCH_MAX, why="2^20 micro-batches per step")
    effective_batch: int | None = opt(None, "images per optimizer step over all GPUs; sets --accum-steps",
                                      parse=_int, min=1, max=BATCH_MAX, why="2^20 images per step")
    # optimization
    epochs: int | None = opt(None, "epochs to train, or auto: 10, or the CPU recipe's on the demo data without "
                                   "a GPU", parse=auto_int, min=1, max=EPOCHS_MAX, why=EPOCHS_WHY)
    optimizer: str = opt("auto", f"{', '.join(OPTIMIZERS)}, or auto: AdamW for runs under 10,000 optimizer steps "
                                 "(it converges faster from scratch), SGD for longer ones",
                         choices=("auto", *OPTIMIZERS))
    lr: float | None = opt(None, "peak learning rate; default 0.1 x batch/256 for SGD (batch = images per "
                                 "optimizer step), 1e-3 for AdamW", parse=_float, min=0.0)
    momentum: float = opt(0.9, "SGD momentum", min=0.0, max=1.0)
    nesterov: bool = opt(False, "Nesterov momentum for SGD")
    weight_decay: float | None = opt(None, "weight decay (not on norms and biases); default 1e-4 for SGD, "
                                           "0.05 for AdamW", parse=_float, min=0.0)
    warmup_epochs: float | None = opt(None, "linear warmup before the cosine schedule, in epochs, or auto: 1, "
                                            "or the CPU recipe's", parse=auto_float, min=0.0, max=EPOCHS_MAX,
                                    why=EPOCHS_WHY)
    label_smoothing: float = opt(0.1, "label smoothing", min=0.0, max=1.0)
    clip_grad: float | None = opt(None, "clip the gradient norm to this value (after unscaling)",
                                  parse=_float, min=0.0)
    ema: bool = opt(False, "keep an exponential moving average of the weights; validate with it")
    ema_decay: float = opt(0.9998, "EMA decay per optimizer step", min=0.0, max=1.0)
    seed: int = opt(0, "random seed", min=0, max=SEED_MAX)
    deterministic: bool = opt(False, "deterministic algorithms (bit-for-bit reproducible CPU runs)")
    max_steps: int | None = opt(None, "stop each epoch after this many micro-batches (quick tries, "
                                      "benchmarks)", parse=_int, min=1)
    # where and how
    device: str = opt("auto", DEVICE_HELP)
    gpus: int = opt(1, "GPUs on this node; more than 1 launches through torchrun", min=1)
    nnodes: int = opt(1, "nodes taking part (torchrun --nnodes)", min=1)
    node_rank: int = opt(0, "this node's rank (torchrun --node-rank)", min=0)
    master_addr: str = opt("127.0.0.1", "address of node 0 (torchrun --master-addr)")
    master_port: int = opt(29500, "port on node 0 (torchrun --master-port)", min=1, max=65535)
    dist_timeout: int = opt(600, "seconds a GPU process waits for the others; a stuck or dead one then "
                                 "stops the run instead of hanging it", min=1)
    # outputs
    project: str = opt("runs", "folder that holds the runs")
    name: str = opt("exp", "run name; exp, exp2, exp3, ... if it exists", parse=folder_name)
    exist_ok: bool = opt(False, "write into an existing run folder instead of a new name")
    resume: str | None = opt(None, "continue a run: a last.pth path, or auto (the newest run's)", parse=_str)
    tensorboard: bool = opt(False, "also write TensorBoard event files")
    mlflow: bool = opt(False, "log to MLflow (MLFLOW_TRACKING_URI, else ./mlflow.db); on when that variable is set")
    mlflow_weights: bool = opt(False, "with MLflow, also send best_model.pth and last.pth as artifacts")


@dataclass(frozen=True)
class ValConfig:
    """Options of `val`."""

    weights: str | None = opt(None, "weights file to validate (best_model.pth, last.pth or a bare "
                                    "state dict with --model)", parse=_str)
    data: str | None = opt(None, "folder of class folders, or a dataset with val/; default: the data the "
                                 "run trained on", parse=_str)
    model: str | None = opt(None, "architecture, for a bare state dict from another tool; or the run file's "
                                  "FILE.py:factory again, to trust one outside the working folder", parse=_str)
    trust_pickle: bool = trust_pickle()
    batch_size: int = opt(64, "batch size", min=1, max=BATCH_MAX, why=BATCH_WHY)
    img_size: int | None = opt(None, "image size; default: the run file's (a bare state dict's preprocess.yaml, "
                                     "else 224)", parse=_int, min=16, max=IMG_SIZE_MAX, why=IMG_WHY)
    normalize: str = normalize_option()
    resize: str = resize_option()
    workers: int | str = opt("auto", "DataLoader worker processes: a number (0: load in the main "
                                     "process; at most 4 per CPU, or 64), or auto", parse=workers_or_auto,
                             here=workers_here)
    amp: bool = opt(False, "validate under AMP even if the model was trained in fp32")
    precision: str = opt("auto", "auto: the precision the model was trained in (its AMP dtype, or fp32); "
                                 "or fp32, fp16, bf16", choices=("auto", "fp32", "fp16", "bf16"))
    device: str = opt("auto", DEVICE_HELP)
    out: str | None = opt(None, "output folder; default <weights dir>/val/", parse=_str)


@dataclass(frozen=True)
class UnpackConfig:
    """Options of `unpack`."""

    archive: str | None = opt(None, f"the archive: {archives.suffixes_said()}",
                              parse=_str, positional=True)
    dest: str | None = opt(None, "destination folder; default data/<archive stem>/", parse=_str)
    overwrite: bool = opt(False, "replace a non-empty destination (only after the new extraction "
                                 "succeeded)")
    report: bool = opt(True, "print the dataset report at the end")
    name_encoding: str = opt("auto", "code page of zip member names stored without the UTF-8 flag: auto "
                                     "(UTF-8, else the best fit of GBK, Shift-JIS, Big5, EUC-KR) or a "
                                     "codec name such as gbk or cp932")
    max_ratio: float = opt(100.0, "refuse an archive that unpacks to more than this many times its own "
                                  "size (a decompression bomb); under 64 MiB unpacked is always allowed",
                           min=1.0)
    keep_code: bool = opt(False, "keep the code an archive holds (Python sources and bytecode, shared objects, "
                                 "scripts); by default it is left out and listed: a dataset is data")


@dataclass(frozen=True)
class DataReportConfig:
    """Options of `data-report`."""

    dir: str | None = opt(None, "dataset folder", parse=_str, positional=True)
    json: bool = opt(False, "print JSON instead of text")
    check_images: bool = opt(False, "decode every image (in parallel) to find unreadable ones")
    val_split: float = opt(0.2, "fraction held out for validation when the data has no val/ folder",
                           min=0.0, max=0.9)
    workers: int | str = opt("auto", "processes for --check-images (0: in this process), or auto",
                             parse=workers_or_auto, here=workers_here)


@dataclass(frozen=True)
class DemoDataConfig:
    """Options of `demo-data`."""

    dest: str = opt("data/demo", "where to write the demo dataset")
    train_per_class: int = opt(300, "training images per class", min=1)
    val_per_class: int = opt(60, "validation images per class", min=1)
    size: int = opt(64, "image size in pixels", min=16, max=IMG_SIZE_MAX, why=IMG_WHY)
    seed: int = opt(0, "random seed (the same seed gives the same images)", min=0, max=SEED_MAX)
    overwrite: bool = opt(False, "replace an existing demo dataset")


@dataclass(frozen=True)
class VerifyEnvConfig:
    """Options of `verify-env`."""

    json: bool = opt(False, "print JSON instead of text")
    allow_cpu: bool = opt(False, "pass on a machine without a GPU")
    workers: int | str = opt("auto", "DataLoader workers the trainer would use (for the /dev/shm check)",
                             parse=workers_or_auto, here=workers_here)


@dataclass(frozen=True)
class BenchDataConfig:
    """Options of `bench-data`."""

    data: str | None = opt(None, "dataset folder; default: the demo dataset", parse=_str)
    model: str = opt("resnet50", "model whose synthetic-data speed is the target")
    batch_size: int = opt(128, "batch size", min=1, max=BATCH_MAX, why=BATCH_WHY)
    img_size: int | None = opt(None, "image size, or auto (the default): what training uses, the data's typical "
                                     "size capped at 224", parse=auto_int, min=16, max=IMG_SIZE_MAX, why=IMG_WHY)
    amp: bool = opt(True, "measure the model under AMP")
    workers: tuple = opt((0, 2, 4, 8, 16), "worker counts to try, comma-separated", parse=int_list, min=0,
                         here=workers_here)
    batches: int = opt(30, "batches timed per measurement", min=2)
    device: str = opt("auto", DEVICE_HELP)
    decoder: str = opt("auto", "JPEG decoder, as for train", choices=_DECODERS)
    gpu_augment: str = opt("auto", "measure the GPU-augmentation path (auto: on a GPU), or the classic "
                                   "one (off)", choices=("auto", "on", "off"))
    decode_overlap: str = decode_overlap()
    cache: bool = opt(False, "also measure --cache (decodes the dataset once)")
    cache_mode: str = opt("auto", "where --cache keeps the decoded images", choices=("auto", "ram", "disk", "gpu"))
    cache_dir: str = opt(".dlenv-cache", "folder of --cache-mode disk files")


@dataclass(frozen=True)
class PruneConfig:
    """Options of `prune`."""

    weights: str | None = opt(None, "weights file to prune", parse=_str)
    trust_pickle: bool = trust_pickle()
    model: str | None = opt(None, "the run file's FILE.py:factory again, to trust one outside the working "
                                  "folder", parse=_str)
    amount: float = opt(0.3, "share of the weights to remove, in (0, 1): those of smallest magnitude "
                             "(global L1 pruning)", parse=open_fraction)
    structured: bool = opt(False, "remove whole channels of smallest L1 norm (smaller and faster) instead of "
                                  "zeroing single weights")
    data: str | None = opt(None, "validation data for top-1 before and after; default: the run file's",
                           parse=_str)
    finetune_epochs: int = opt(0, "epochs of fine-tuning after pruning, on the run file's training data",
                               min=0, max=EPOCHS_MAX, why=EPOCHS_WHY)
    finetune_lr: float = opt(0.01, "SGD learning rate of the fine-tuning", min=0.0)
    batch_size: int = opt(64, "batch size", min=1, max=BATCH_MAX, why=BATCH_WHY)
    workers: int | str = opt("auto", "DataLoader worker processes, or auto",
                             parse=workers_or_auto, here=workers_here)
    device: str = opt("auto", DEVICE_HELP)
    out: str | None = opt(None, "output weights file; default <stem>_pruned.pth beside the input", parse=_str)


@dataclass(frozen=True)
class ExportConfig:
    """Options of `export`."""

    weights: str | None = opt(None, "weights file to export", parse=_str)
    trust_pickle: bool = trust_pickle()
    model: str | None = opt(None, "the run file's FILE.py:factory again, to trust one outside the working "
                                  "folder", parse=_str)
    format: str = opt("onnx", "onnx, torchscript, or safetensors (the weights alone, loadable without "
                              "running code)", choices=("onnx", "torchscript", "safetensors"))
    quantize: str = opt("none", "int8 for CPU: int8 (calibrated; onnx: onnxruntime's QDQ), static (the same), or "
                                "dynamic (linear layers, torchscript)", choices=("none", "int8", "static", "dynamic"))
    half: bool = opt(False, "fp16 export for GPU inference")
    data: str | None = opt(None, "images for the output check and static calibration; default: the "
                                 "run file's", parse=_str)
    calib_batches: int = opt(8, "calibration batches for --quantize int8/static", min=1)
    batch_size: int = opt(32, "batch size for checks and calibration", min=1, max=BATCH_MAX, why=BATCH_WHY)
    workers: int | str = opt("auto", "DataLoader worker processes, or auto",
                             parse=workers_or_auto, here=workers_here)
    opset: int = opt(17, "ONNX opset", min=7)
    out: str | None = opt(None, "output file; default beside the weights file", parse=_str)


@dataclass(frozen=True)
class Command:
    """One verb: its options class, the function that runs it ('module:function'), its help line."""

    name: str
    config: type
    target: str
    help: str


COMMANDS: dict[str, Command] = {c.name: c for c in [
    Command("verify-env", VerifyEnvConfig, "dlenv.envcheck:main",
            "Check versions, GPUs, real kernels, /dev/shm and disk; one verdict."),
    Command("unpack", UnpackConfig, "dlenv.data.unpack:main",
            "Safely unpack a dataset archive into data/<name>/ and report on it."),
    Command("data-report", DataReportConfig, "dlenv.data.report:main",
            "Report a dataset: classes, counts, image sizes, bad files, train/val leaks."),
    Command("demo-data", DemoDataConfig, "dlenv.data.demo:main",
            "Write the built-in demo dataset (generated, no download)."),
    Command("train", TrainConfig, "dlenv.train:main",
            "Train a classifier (AMP, activation checkpointing, accumulation, resume)."),
    Command("val", ValConfig, "dlenv.evaluate:main",
            "Validate a weights file: metrics, per-class report, confusion matrix, errors."),
    Command("plot", PlotConfig, "dlenv.runfolder.plots:main",
            "Plot each run's results.csv (and compare runs)."),
    Command("runs", RunsConfig, "dlenv.runfolder.runsview:main", "Every run in one table; two runs compared."),
    Command("bench-memory", BenchMemoryConfig, "dlenv.bench.memory:main",
            "Measure memory and speed: FP32, AMP, checkpointing, both; allocator settings."),
    Command("bench-data", BenchDataConfig, "dlenv.bench.data:main",
            "Measure the input pipeline against the model and name the bottleneck."),
    Command("watch", WatchConfig, "dlenv.watch.run:main", "Run a command and watch the GPU: busy, memory, advice."),
    Command("prune", PruneConfig, "dlenv.compress:prune_main",
            "Prune a weights file (single weights, or whole channels) and re-validate it."),
    Command("export", ExportConfig, "dlenv.compress:export_main",
            "Export a weights file to ONNX or TorchScript (optionally int8) and check its outputs."),
    Command("predict", PredictConfig, "dlenv.predict:main",
            "Predict images, a folder, a glob, a video or stdin paths with a trained model: top-k to a CSV."),
    Command("lab", LabConfig, "dlenv.servers:lab",
            "Start JupyterLab on port 8888 (this Python as its kernel); prints the URL with its token."),
    Command("tensorboard", TensorboardConfig, "dlenv.servers:tensorboard",
            "Serve the runs' TensorBoard event files (train --tensorboard) on port 6006."),
    Command("mlflow", MlflowConfig, "dlenv.servers:mlflow_ui",
            "Serve the MLflow UI over the local store (train --mlflow) on port 5000."),
]}


# ---------------------------------------------------------------------------------------------------
# Building configs.


def options(cls: type) -> list[dataclasses.Field]:
    """The declared options of a config class, in declaration order."""
    return list(dataclasses.fields(cls))


#: what a command other than train takes from a run's config.yaml (train's options, every one): the
#: options that mean the same there. The others are left out, in one line: train's --weights is the
#: file it started from, not the one to validate; its --data given to val would validate on every image
#: of a folder of class folders (training images too), where the run file names the held-out part.
_FROM_RUN: dict[type, tuple[str, ...]] = {
    ValConfig: ("batch_size", "workers", "device"),
    PruneConfig: ("batch_size", "workers", "device"),
    ExportConfig: ("batch_size", "workers"),
    DataReportConfig: ("val_split", "workers"),
    VerifyEnvConfig: ("workers",),
    BenchMemoryConfig: ("model", "batch_size", "img_size", "channels_last", "amp_dtype", "device"),
    BenchDataConfig: ("data", "model", "batch_size", "img_size", "device", "decoder", "gpu_augment",
                      "decode_overlap", "cache_mode", "cache_dir"),
}


def _command_of(cls: type) -> str:
    return next((c.name for c in COMMANDS.values() if c.config is cls), cls.__name__)


def _from_file(cls: type, yaml_file: str | Path, say: Callable[[str], None]) -> dict[str, Any]:
    """The options of `cls` in a --cfg file (dlenv.options.cfgfile.options_in: a run's config.yaml gives another
    command only what `_FROM_RUN` names)."""
    return options_in(yaml_file, {f.name for f in options(cls)}, {f.name for f in options(TrainConfig)},
                      () if cls is TrainConfig else _FROM_RUN.get(cls, ()), _command_of(cls), say)


def build(cls: type, yaml_file: str | Path | None = None, /, **given: Any) -> Any:
    """Build a frozen config: defaults < YAML file < `given` (already-typed or string values).

    Keys may use dashes or underscores. A run's config.yaml may be passed to another command (val,
    prune, ...): `_from_file` says in one line what it takes from it. Raises UserError for unknown
    keys (listing the valid ones), values that don't parse, choices and ranges.
    """
    return _build(cls, yaml_file, given, here=True)


def _build(cls: type, yaml_file: str | Path | None, given: dict[str, Any], here: bool) -> Any:
    valid = {f.name: f for f in options(cls)}
    merged: dict[str, Any] = {}
    from_file: set[str] = set()
    layers = [_from_file(cls, yaml_file, print) if yaml_file else {}, given]
    for i, layer in enumerate(layers):
        for key, value in layer.items():
            name = str(key).replace("-", "_")
            if name not in valid:
                raise UserError(f"unknown option {key!r}; valid options: "
                                f"{', '.join(sorted(f.replace('_', '-') for f in valid))}")
            merged[name] = value
            (from_file.add if i == 0 else from_file.discard)(name)
    values = {}
    for name, v in merged.items():
        try:
            values[name] = parse_option(valid[name], v, here)
        except UserError as e:
            if name in from_file:  # say where the bad value came from
                raise UserError(f"{e} (set in config file {yaml_file})") from None
            raise
    return cls(**values)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-typed dict of a config (lists for tuples), for YAML files and run files."""
    out = {}
    for f in options(type(cfg)):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a config saved by `to_dict`, ignoring keys this version no longer has. The bounds that
    depend on this machine (`opt(here=)`) are not applied: a run made with 100 workers on 128 CPUs
    still validates or resumes on 8 (a resume takes --workers from its own command)."""
    names = {f.name for f in options(cls)}
    return _build(cls, None, {k: v for k, v in data.items() if k in names}, here=False)
