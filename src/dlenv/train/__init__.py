"""The trainer: `dlenv train` / `invoke train` / `dlenv.train.train(cfg)`.

This face only hands names on, and only when they are asked for: `from dlenv.train.loop import ...`
(or dlenv.train.auto, .console) runs nothing else of the trainer.

    run.py      `train(cfg)` = plan -> parts -> fit; `main` (with --gpus N, torchrun)
    plan.py     every setup decision once, with its reason: TrainPlan, ModelSpec (builds nothing)
    parts.py    the model, the data and the step's parts, built from the plan
    fit.py      the epochs: validate, results.csv, last.pth / best_model.pth, memory.md
    loop.py     the epoch: forward, backward and the optimizer step; validation
    auto.py     what the auto options become on this machine (--compile, --checkpoint-ratio, --batch-size)
    console.py  progress, the epoch line, SIGINT/SIGTERM

What a run saves and resumes from is dlenv.runfolder.trainstate, beside the run folder's other files.
"""

from __future__ import annotations

__all__ = ["EXIT_NONFINITE", "EXIT_OOM", "TrainState", "main", "train"]


def __getattr__(name: str):
    # plain imports (not importlib) so that tests/test_codebase.py sees these edges of the import graph
    if name in ("train", "main"):
        from dlenv.train import run

        return getattr(run, name)
    if name in ("EXIT_OOM", "EXIT_NONFINITE"):
        from dlenv.train import fit

        return getattr(fit, name)
    if name == "TrainState":
        from dlenv.runfolder.trainstate import TrainState

        return TrainState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
