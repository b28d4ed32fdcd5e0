"""One process of a tests/cluster/test_distributed.py scenario: `python _distributed_worker.py SCENARIO [JSON]`.

The test starts WORLD_SIZE of these with RANK/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (as torchrun
would), on the CPU with gloo. Each prints one line `RESULT <json>` for the test to check.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from dlenv.cluster import distributed
from dlenv.errors import UserError


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def collectives_scenario(args: dict) -> None:
    """The metric reduction and the no_sync accumulation, in one process group."""
    info = distributed.init_from_env(timeout_s=30, device="cpu")
    result(rank=info.rank, reduce=reduce_check(info, args["n"]), nosync=nosync_check(info, args["micro"],
                                                                                        args["accum"]))


def reduce_check(info: distributed.DistInfo, n: int) -> dict:
    """Per-rank sums over an uneven EvalShardSampler shard, reduced: must be the whole set's."""
    shard = list(distributed.EvalShardSampler(n, info.rank, info.world_size))
    correct = sum(1 for i in shard if i % 3 == 0)  # sample i is "predicted right" when i % 3 == 0
    sums = distributed.reduce_metrics({"loss": float(sum(shard)), "correct": correct, "count": len(shard)})
    return {"shard": shard, "sums": sums, "main": distributed.is_main()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def nosync_check(info: distributed.DistInfo, micro: int, accum: int) -> dict:
    """Accumulation over micro-batches per rank with no_sync: gradients must equal one process's
    gradients of the whole batch, and must not be averaged after the non-final micro-batch."""
    world = info.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(micro * accum * world, 3, 8, 8, generator=g)
    y = torch.randint(0, 3, (x.shape[0],), generator=g)
    torch.manual_seed(1234 + info.rank)  # different initial weights per rank: DDP must broadcast rank 0's
    model = Net()
    ddp = distributed.wrap_ddp(model, info.device)
    torch.manual_seed(1234)
    reference = Net()  # rank 0's initial weights, trained as one process on the whole batch
    nn.functional.cross_entropy(reference(x), y).backward()

    # like the sampler: rank r takes every world-th sample, micro-batch after micro-batch
    mine = torch.arange(info.rank, x.shape[0], world)
    after_first = None
    for k in range(accum):
        idx = mine[k * micro:(k + 1) * micro]
        last = k == accum - 1
        with distributed.no_sync_context(ddp, last):
            loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx]) / accum
            loss.backward()
        if k == 0:
            after_first = model.fc.weight.grad.clone()
    # what this rank alone contributes after its first micro-batch (nothing averaged yet)
    local = Net()
    local.load_state_dict(reference.state_dict())
    (nn.functional.cross_entropy(local(x[mine[:micro]]), y[mine[:micro]]) / accum).backward()
    diffs = {name: (p.grad - dict(reference.named_parameters())[name].grad).abs().max().item()
             for name, p in model.named_parameters()}
    return {"max_grad_diff": max(diffs.values()),
            "first_is_local": torch.allclose(after_first, local.fc.weight.grad, atol=1e-6),
            "weights_from_rank0": all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(),
                                                                        strict=True))}


def dies_scenario(args: dict) -> None:
    """Rank 1 dies (or hangs) after joining; rank 0's next collective must fail with a clear message."""
    info = distributed.init_from_env(timeout_s=args["timeout"], device="cpu")
    distributed.barrier()
    if info.rank == 1:
        if args["how"] == "exit":
            os._exit(3)
        time.sleep(120)  # stuck: alive but never reaching the collective
        return
    t0 = time.perf_counter()
    try:
        distributed.all_reduce_sum(torch.ones(4))
    finally:
        result(rank=0, seconds=time.perf_counter() - t0)


def torchrun_fail_scenario(args: dict) -> None:
    """Under torchrun: rank 1 exits with status 3, rank 0 waits in a collective."""
    info = distributed.init_from_env(timeout_s=60, device="cpu")
    if info.rank == 1:
        os._exit(3)  # gone at once: torchrun sees it before rank 0's consequent failure
    distributed.all_reduce_sum(torch.ones(1))


def train_scenario(args: dict) -> None:
    """The real trainer with a tiny model and no random augmentation (deterministic per sample)."""
    from tinymodels import Tiny

    import dlenv.data.loaders as loaders
    import dlenv.model.models
    from dlenv import train
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    eval_transforms = loaders.build_transforms
    # every call gets the eval transforms, whatever augmentation options the trainer passes on
    loaders.build_transforms = lambda img_size, train, *a, **kw: eval_transforms(img_size, False)
    # no BatchNorm, no dropout: a run's result depends only on the data order and the gradients
    dlenv.model.models.build_model = lambda name, num_classes, weights=None, **kw: Tiny(num_classes, norm=False,
                                                                                        dropout=0)
    out = train.train(config.build(TrainConfig, **args))
    result(rank=distributed.rank(), summary=out)


def freeze_scenario(args: dict) -> None:
    """The real trainer fine-tuning a Tiny "pretrained" model (conv, BatchNorm, head) with --freeze-epochs:
    the weights come from a fixed state dict instead of a download. Reports, after each optimizer step,
    what the backbone and the head hold, so the test can see them frozen, then trained, alike on each rank."""
    from tinymodels import Tiny

    import dlenv.data.loaders as loaders
    import dlenv.model.models
    from dlenv import train
    from dlenv.model import finetune, pretrained
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    eval_transforms = loaders.build_transforms
    loaders.build_transforms = lambda img_size, train, *a, **kw: eval_transforms(img_size, False)
    torch.manual_seed(7)
    source = Tiny(5, dropout=0.0)
    source.bn.running_mean.uniform_(-1, 1)  # statistics a frozen layer must keep, and training would move
    source.bn.running_var.uniform_(0.5, 2)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    built = []

    def build_model(name, num_classes, weights=None, pretrained_state=None, **kw):
        torch.manual_seed(100 + distributed.rank())  # heads differ per rank until DDP broadcasts rank 0's
        model = Tiny(num_classes, dropout=0.0)
        model.load_state_dict({**model.state_dict(), **(pretrained_state or {})})
        built.append(model)
        return model

    dlenv.model.models.build_model = build_model
    weights = pretrained.Weights(model="tiny", name="Tiny_Weights.TEST", source="torchvision", file="tiny.pth",
                                 url="http://127.0.0.1/none", num_classes=5, img_size=16)
    pretrained.resolve = lambda model, name: weights
    finetune.Plan.state = lambda self: state if self.fetch else None
    steps = []

    def on_step(st):
        m = built[-1]
        steps.append({"epoch": st.epoch, "conv": m.conv.weight.sum().item(), "bn_w": m.bn.weight.sum().item(),
                      "bn_mean": m.bn.running_mean.tolist(), "fc": m.fc.weight.sum().item()})

    out = train.train(config.build(TrainConfig, **args), on_step=on_step)
    result(rank=distributed.rank(), summary=out, steps=steps,
           source={"conv": source.conv.weight.sum().item(), "bn_w": source.bn.weight.sum().item(),
                   "bn_mean": source.bn.running_mean.tolist()},
           final=[p.detach().flatten().tolist() for p in built[-1].parameters()])


def exact_scenario(args: dict) -> None:
    """The real trainer with random augmentation (crops, flips) and a model with dropout and BatchNorm, so each
    rank draws its own random numbers. With `stop_at`, rank 0 sends itself SIGTERM after that optimizer step
    (the signal reaching one rank: the ranks' vote takes it to both); `vote_s` sets the vote's period
    (dlenv.train.console.VOTE_S: 0 votes after every step, so the stop comes at that very step)."""
    import signal

    from tinymodels import Tiny

    import dlenv.model.models
    from dlenv import train
    from dlenv.options import config
    from dlenv.options.config import TrainConfig
    from dlenv.train import console

    dlenv.model.models.build_model = lambda name, num_classes, weights=None, **kw: Tiny(num_classes, dropout=0.3)
    console.VOTE_S = args.pop("vote_s", console.VOTE_S)
    stop_at = args.pop("stop_at", None)

    def on_step(st):
        if st.step == stop_at and distributed.rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    out = train.train(config.build(TrainConfig, **args), on_step=on_step)
    result(rank=distributed.rank(), summary=out)
    if out["exit_code"]:
        sys.stdout.flush()
        os._exit(out["exit_code"])  # as dlenv's CLI exits after a stop


SCENARIOS = {"collectives": collectives_scenario, "exact": exact_scenario, "dies": dies_scenario,
             "torchrun_fail": torchrun_fail_scenario, "train": train_scenario, "freeze": freeze_scenario}

if __name__ == "__main__":
    try:
        SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    except UserError as e:  # as dlenv.cli reports it
        print(f"dlenv train: error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)  # no process-group teardown: it would wait for the dead peer
    distributed.cleanup()
