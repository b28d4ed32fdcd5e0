"""dlenv.train.loop's rescue of a batch's forward and backward (Rescue.run), case by case: what each
attempt raised -> how many attempts ran, what propagated, what the rescue said. The whole loop trains in
test_train.py and test_train_auto.py (a real failed compile); a real out-of-memory error in test_train_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dlenv.train import loop


class CompileError(RuntimeError):
    """What torch.compile's machinery raises (compat.is_compile_error reads the module of the class)."""


CompileError.__module__ = "torch._dynamo.exc"

OOM = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

#: (id, errors raised by the attempts in turn, with an eager model kept?, retry_oom, what comes out:
#:  the attempts run, or the exception type that propagates)
CASES = [
    ("done", [], True, False, 1),
    ("failed-compile", [CompileError("inductor crashed")], True, False, 2),
    ("failed-compile-without-eager", [CompileError("inductor crashed")], False, False, CompileError),
    ("compile-fails-eagerly-too", [CompileError("a"), CompileError("b")], True, False, CompileError),
    ("model-error", [ValueError("a shape bug of the model")], True, False, ValueError),
    ("oom-halves", [OOM], False, True, loop.Replan),
    ("oom-without-auto", [OOM], True, False, RuntimeError),
    ("a-stop", [KeyboardInterrupt()], True, True, KeyboardInterrupt),
]


@pytest.mark.parametrize(("errors", "eager", "retry_oom", "outcome"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_an_attempt_is_rescued_or_its_error_propagates(errors, eager, retry_oom, outcome):
    zeroed, said = [], []
    parts = SimpleNamespace(model="compiled", eager="eager" if eager else None,
                            optimizer=SimpleNamespace(zero_grad=lambda set_to_none: zeroed.append(set_to_none)))
    state = SimpleNamespace(batch_in_epoch=5, position=40, accum_steps=4)
    progress = SimpleNamespace(update=lambda *a: None)
    rescue = loop.Rescue(parts, state, progress, said.append, retry_oom=retry_oom)
    window = loop._Window()
    window.open(state, total=8)  # a window of min(4, 8 - 5) = 3 micro-batches
    window.close_one(8)  # one of them done: batch 5 is the window's second
    state.batch_in_epoch, state.position = 6, 48
    raised, ran, models = list(errors), [], []

    def step(on, images, targets, scale, sync, monitor):  # forward_backward's arguments
        assert (on, images, targets, sync, monitor) == (parts, "images", "targets", window.closing, None)
        ran.append(round(1 / scale))  # the loss is divided by the window's size
        models.append(parts.model)
        if raised:
            raise raised.pop(0)
        return "loss"

    def attempts() -> int:
        assert rescue.run(step, "images", "targets", window, 8, None) == "loss"
        return len(ran)

    if isinstance(outcome, int):
        assert attempts() == outcome
    else:
        with pytest.raises(outcome) as err:
            attempts()
        assert str(err.value) == str(errors[-1]) or outcome is loop.Replan
    if outcome == 2:  # redone eagerly, the window starting again at this batch: its size read afresh
        assert models == ["compiled", "eager"] and parts.eager is None and ran == [3, 2] and zeroed == [True]
        assert said == ["--compile: torch.compile failed (CompileError: inductor crashed); training eagerly from here; "
                        "1 micro-batch(es) of this window are skipped"]
    if outcome is loop.Replan:  # back at the last optimizer step, the window's one micro-batch undone
        assert err.value.dropped == 1 and (state.batch_in_epoch, state.position) == (5, 40) and zeroed == [True]
    if outcome in (1, CompileError, ValueError, RuntimeError, KeyboardInterrupt) and len(errors) < 2:
        assert models == ["compiled"] and said == [] and zeroed == []
