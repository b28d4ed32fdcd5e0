"""How `dlenv VERB --help` presents a command's options: in named groups, then examples.

The options themselves are declared once, in dlenv.config; this module only sorts their names into the
groups `--help` shows (a command without an entry lists its few options in one block) and holds the
examples its help ends with, the commands docs/training.md and docs/validation.md open with. A test holds
every option of a grouped command in exactly one group, so a new option cannot go missing from --help.
No torch here: `dlenv --help` imports it.
"""

from __future__ import annotations

#: command -> (group title, option names) in the order --help shows them; options keep their declared
#: order within a group. "cfg" is the --cfg every command takes.
GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "train": (
        ("data", ("data", "val_split", "img_size", "workers", "bad_images", "cache", "cache_mode", "cache_dir",
                  "decoder", "gpu_augment", "augment", "hflip", "crop_scale", "synthetic")),
        ("model", ("model", "model_args", "weights", "trust_pickle", "pretrained", "freeze_epochs", "backbone_lr",
                   "sync_bn")),
        ("optimisation", ("epochs", "optimizer", "lr", "momentum", "nesterov", "weight_decay", "warmup_epochs",
                          "label_smoothing", "clip_grad", "ema", "ema_decay", "seed", "deterministic", "max_steps")),
        ("precision and memory", ("amp", "amp_dtype", "batch_size", "accum_steps", "effective_batch", "checkpoint",
                                  "checkpoint_ratio", "channels_last", "compile")),
        ("run", ("cfg", "device", "gpus", "nnodes", "node_rank", "master_addr", "master_port", "dist_timeout",
                 "project", "name", "exist_ok", "resume", "tensorboard")),
    ),
}

#: command -> the examples its --help ends with: (command line, what it does)
EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("dlenv train --amp --checkpoint", "the built-in demo data, resnet18"),
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
}


def epilog(command: str) -> str | None:
    """The examples block ending `command`'s --help (None without examples), one command a line with
    what it does on the line below it."""
    examples = EXAMPLES.get(command)
    if not examples:
        return None
    return "examples:\n" + "\n".join(f"  {line}\n      {what}" for line, what in examples)
