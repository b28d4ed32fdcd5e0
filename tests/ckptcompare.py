"""One training step of a model without and with activation checkpointing, from the same weights, input and
seed, and the comparison of the two (outputs, gradients, every buffer, the RNG after): tests/model/'s
test_checkpointing.py on torchvision's families, test_usermodel_train.py on models of one's own."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dlenv.model.checkpointing import apply_checkpointing


def train_step(model, batches, precision=None):
    """Forward + backward over micro-batches (accumulating); returns outputs, grads, buffers."""
    torch.manual_seed(1234)  # the dropout / stochastic-depth stream
    outs = []
    for x, y in batches:
        ctx = precision.autocast() if precision else torch.autocast("cpu", enabled=False)
        with ctx:
            out = model(x)
            loss = F.cross_entropy(out.float(), y) / len(batches)
        loss.backward()
        outs.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return outs, grads, buffers, torch.get_rng_state()


def compare_plain_and_checkpointed(model, batches, ratio=1.0, precision=None):
    """Run the step without and with checkpointing from the same weights; return (plain, ckpt, n)."""
    model.train()
    start = copy.deepcopy(model.state_dict())
    plain = train_step(model, batches, precision)
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    n = apply_checkpointing(model, ratio)
    ckpt = train_step(model, batches, precision)
    return plain, ckpt, n


def assert_same(plain, ckpt, exact_grads=True):
    p_out, p_grads, p_bufs, p_rng = plain
    c_out, c_grads, c_bufs, c_rng = ckpt
    for a, b in zip(p_out, c_out, strict=False):
        assert torch.equal(a, b), "outputs differ"
    assert p_grads.keys() == c_grads.keys()
    for k in p_grads:
        if exact_grads:
            torch.testing.assert_close(c_grads[k], p_grads[k], rtol=1e-5, atol=1e-7, msg=f"grad {k}")
        else:
            torch.testing.assert_close(c_grads[k], p_grads[k], msg=f"grad {k}")
    assert p_bufs.keys() == c_bufs.keys()
    for k in p_bufs:
        assert torch.equal(p_bufs[k], c_bufs[k]), f"buffer {k} differs (BatchNorm updated twice?)"
    # The global RNG ends where it would have: the recompute forks it, the next step is unchanged.
    assert torch.equal(p_rng, c_rng)
