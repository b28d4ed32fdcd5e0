"""How `dlenv --help` presents the verbs, and `dlenv VERB --help` a command's options.

`dlenv --help` (and `dlenv` alone) is `top_help()`: the verbs in groups (data, train, evaluate, deploy,
environment), each with what it does and one example line, written from `VERBS` alone, so that it imports
neither the option declarations (dlenv.options.config) nor anything else: it answers at once. A test holds VERBS
to the verbs dlenv.options.config declares.

The options themselves are declared once, in dlenv.options.config; this module only sorts their names into the
groups `VERB --help` shows (a command without an entry lists its few options in one block) and holds the
examples its help ends with, the commands docs/training.md and docs/validation.md open with. A test holds
every option of a grouped command in exactly one group, so a new option cannot go missing from --help.
No torch here.
"""

from __future__ import annotations

#: `dlenv --help`: (group, ((verb, what it does, an example), ...)), in the order shown
VERBS: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = (
    ("data", (
        ("unpack", "unpack a dataset archive safely into data/<name>/ and report on it", "dlenv unpack pets.zip"),
        ("data-report", "classes, counts, image sizes, bad files, train/val leaks", "dlenv data-report data/pets"),
        ("demo-data", "write the built-in demo dataset (generated, no download)", "dlenv demo-data"),
    )),
    ("train", (
        ("train", "train a classifier (AMP, activation checkpointing, accumulation, resume)",
         "dlenv train --data data/pets --amp --checkpoint"),
        ("bench-memory", "memory and speed: FP32, AMP, checkpointing, allocator settings",
         "dlenv bench-memory --model resnet50"),
        ("bench-data", "measure the input pipeline against the model; name the bottleneck",
         "dlenv bench-data --data data/pets"),
        ("watch", "run any command and watch the GPU: busy, memory, power, advice",
         "dlenv watch -- python train.py"),
    )),
    ("evaluate", (
        ("val", "metrics, per-class report, confusion matrix, errors of a weights file",
         "dlenv val --weights best_model.pth"),
        ("plot", "plot each run's results.csv (and compare runs)", "dlenv plot --log-dir runs"),
        ("runs", "every run in one table: epochs, best top-1, img/s, memory, how it ended",
         "dlenv runs --sort top1"),
        ("predict", "predict images, a folder, a glob, a video or stdin paths",
         "dlenv predict --weights best_model.pth --source photo.jpg"),
    )),
    ("deploy", (
        ("prune", "prune a weights file (single weights or whole channels) and re-validate it",
         "dlenv prune --weights best_model.pth --structured --finetune-epochs 3"),
        ("export", "export to ONNX, TorchScript or safetensors (optionally int8) and check it",
         "dlenv export --weights best_model.pth --format onnx"),
    )),
    ("environment", (
        ("verify-env", "versions, GPUs, real kernels, /dev/shm and disk; one verdict", "dlenv verify-env"),
        ("lab", "JupyterLab on port 8888 with this Python as its kernel", "dlenv lab"),
        ("tensorboard", "serve the runs' TensorBoard event files on port 6006", "dlenv tensorboard"),
        ("mlflow", "serve the MLflow UI over the local store (train --mlflow) on port 5000", "dlenv mlflow"),
        ("test", "the quick tests with a progress line and an ETA", "dlenv test"),
    )),
)


def top_help(version: str) -> str:
    """`dlenv --help`: usage, the verbs by group with an example each, and where to read more."""
    width = max(len(verb) for _, verbs in VERBS for verb, _, _ in verbs)
    out = ["usage: dlenv VERB [options]      (dlenv VERB --help: its options and examples)", "",
           "GPU training environment for image classifiers. Every verb is also an invoke task (invoke VERB).", ""]
    for group, verbs in VERBS:
        out.append(f"{group}:")
        for verb, what, example in verbs:
            out.append(f"  {verb:<{width}}  {what}")
            out.append(f"  {'':<{width}}    e.g. {example}")
        out.append("")
    out.append(f"options: -h, --help (this), --version (dlenv {version})")
    return "\n".join(out)


#: command -> (group title, option names) in the order --help shows them; options keep their declared
#: order within a group. "cfg" is the --cfg every command takes.
GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "train": (
        ("data", ("data", "val_split", "img_size", "workers", "bad_images", "cache", "cache_mode", "cache_dir",
                  "decoder", "gpu_augment", "decode_overlap", "augment", "hflip", "crop_scale", "synthetic",
                  "channels")),
        ("model", ("model", "model_args", "weights", "trust_pickle", "pretrained", "freeze_epochs", "backbone_lr",
                   "sync_bn")),
        ("optimisation", ("epochs", "optimizer", "lr", "momentum", "nesterov", "weight_decay", "warmup_epochs",
                          "label_smoothing", "clip_grad", "ema", "ema_decay", "seed", "deterministic", "max_steps")),
        ("precision and memory", ("amp", "amp_dtype", "batch_size", "accum_steps", "effective_batch", "checkpoint",
                                  "checkpoint_ratio", "channels_last", "compile")),
        ("run", ("cfg", "device", "gpus", "nnodes", "node_rank", "master_addr", "master_port", "dist_timeout",
                 "project", "name", "exist_ok", "resume", "tensorboard", "mlflow", "mlflow_weights")),
    ),
}

#: command -> the examples its --help ends with: (command line, what it does)
EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("dlenv train --amp --checkpoint", "the one dataset under data/ (else the built-in demo), resnet18"),
        ("dlenv train --data data/pets --model resnet50 --epochs 30 --batch-size 64 --amp --accum-steps 4",
         "your data, a bigger model, 256 images per step"),
        ("dlenv train --data data/pets --model resnet50 --pretrained", "ImageNet weights, fine-tuned"),
        ("dlenv train --model models/net.py:build --amp --checkpoint", "a model of your own (docs/training.md)"),
        ("dlenv train --resume runs/exp3/last.pth", "continue a stopped run (--resume auto: the newest)"),
    ),
    "val": (
        ("dlenv val --weights runs/exp/best_model.pth", "on the data it was trained on; reports in runs/exp/val/"),
        ("dlenv val --weights runs/exp/best_model.pth --data data/pets/val", "on a folder of class folders"),
        ("dlenv val --weights resnet50_from_elsewhere.pth --model resnet50 --data data/pets/val",
         "a bare state dict from another tool"),
    ),
    "runs": (
        ("dlenv runs", "every run under runs/: model, data, epochs, best top-1, img/s, peak memory, wall, status"),
        ("dlenv runs --sort top1", "best first"),
        ("dlenv runs --compare exp exp2", "the options and decisions that differ, final metrics, where time went"),
        ("dlenv runs --format csv > runs.csv", "the data behind the table (or --format json)"),
    ),
    "prune": (
        ("dlenv prune --weights runs/exp/best_model.pth --amount 0.3",
         "zero the 30% of weights of smallest magnitude (global L1, unstructured) and re-validate"),
        ("dlenv prune --weights runs/exp/best_model.pth --structured --finetune-epochs 3",
         "remove whole channels (L1 norm), then fine-tune 3 epochs"),
    ),
}


def epilog(command: str) -> str | None:
    """The examples block ending `command`'s --help (None without examples), one command a line with
    what it does on the line below it."""
    # a verb without examples of its own ends with its line of `dlenv --help`
    examples = EXAMPLES.get(command) or tuple((ex, what) for _, verbs in VERBS for verb, what, ex in verbs
                                              if verb == command)
    if not examples:
        return None
    return "examples:\n" + "\n".join(f"  {line}\n      {what}" for line, what in examples)
