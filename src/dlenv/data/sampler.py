"""A seeded, resumable sampler: the order of an epoch depends only on (seed, epoch).

The training order is a permutation drawn from a generator seeded with `seed + epoch`, never from
the global RNG, so a run resumed in the middle of an epoch sees exactly the samples the interrupted
run had not reached yet: `set_epoch(epoch, start=position)` skips the first `position` indices of
this rank's share. `rank`/`world_size` split each epoch's permutation between GPUs the way
`torch.utils.data.DistributedSampler` does (padded to a multiple of the world size, then every
`world_size`-th index), so distributed training reuses this class as is.

`batch_size` keeps a lone sample out of training: when a rank's share would end in a batch of one
image (80 images, batch 79), that last index is left out of the epoch (a different one each shuffled
epoch). BatchNorm in train mode cannot normalise one sample and raises; leaving the index out here,
rather than in each loader, keeps every path (DataLoader, DeviceLoader, DDP shards) and the epoch
arithmetic (`per_rank`, steps per epoch, the resume position) consistent.

The sampler does not count what the DataLoader consumed (workers prefetch ahead of training); the
trainer tracks the position of the batches it actually trained on and saves it in the run file.

`SeededDraws` hands the same indices out as `Draw`s: ints that carry the seed of their sample's random
augmentation, `draw_seed(seed, epoch, index)`. The dataset draws a sample's crop and flip from that seed
(dlenv.data.loaders), not from a DataLoader worker's own stream, whose state depends on every sample the
worker drew before: so a resumed run, any number of ranks and any number of workers give each sample of
an epoch the augmentation the uninterrupted run gave it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

_MASK64 = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample `index`'s augmentation in `epoch` of a run seeded `seed` (below 2**63)."""
    return _mix(_mix(_mix(seed) ^ epoch) ^ index) >> 1


class Draw(int):
    """A sample index that carries `seed`, the seed its augmentation is drawn from (`draw_seed`). Anything
    that indexes with it sees a plain int; it pickles to the DataLoader workers with its seed."""

    seed: int

    def __new__(cls, index: int, seed: int) -> Draw:
        out = super().__new__(cls, index)
        out.seed = seed
        return out

    def __reduce__(self):
        return Draw, (int(self), self.seed)


def lone_last(n: int, batch_size: int) -> bool:
    """Whether `n` samples in batches of `batch_size` end in a batch of one (to leave out in training)."""
    return batch_size > 1 and n > 1 and n % batch_size == 1


class ResumableSampler(Sampler[int]):
    """Indices 0..num_samples-1 in a (seed, epoch)-determined order, from `start` on.

    `shuffle=False` keeps the natural order (validation). With `world_size` > 1 each rank gets
    ceil(num_samples / world_size) indices (the permutation is padded by repeating its head, or
    truncated with `drop_last`). With `batch_size` > 1 a share that would end in a one-sample batch
    is one index shorter. Raises ValueError for a bad rank, world size or start.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, batch_size: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self.start = 0

    @property
    def per_rank(self) -> int:
        """Indices this rank gets in a whole epoch (never a last batch of one, see the module doc)."""
        if self.drop_last:
            share = self.num_samples // self.world_size
        else:
            share = math.ceil(self.num_samples / self.world_size)
        return share - 1 if lone_last(share, self.batch_size) else share

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip this rank's first `start` indices (0 = a whole epoch)."""
        if not 0 <= start <= self.per_rank:
            raise ValueError(f"start {start} is outside this epoch's {self.per_rank} samples")
        self.epoch, self.start = epoch, start

    def epoch_indices(self) -> list[int]:
        """This rank's indices for the whole current epoch (ignoring `start`)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.per_rank * self.world_size
        if total > len(order) and order:
            # pad by repeating the head so every rank gets the same number of indices
            order = (order * math.ceil(total / len(order)))[:total]
        else:
            order = order[:total]
        return order[self.rank:total:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start

    def state_dict(self, position: int) -> dict[str, int]:
        """Plain-typed state for a run file; `position` = samples of this epoch already trained on."""
        return {"seed": self.seed, "epoch": self.epoch, "position": int(position),
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where `state_dict` was taken: same seed, epoch and position.

        A different world size cannot continue mid-epoch (the shares differ): it restarts the epoch.
        """
        self.seed = int(state["seed"])
        same_split = int(state.get("world_size", 1)) == self.world_size
        self.set_epoch(int(state["epoch"]), int(state["position"]) if same_split else 0)


class SeededDraws(Sampler[int]):
    """`sampler`'s indices (a ResumableSampler: its current epoch, from its start) as `Draw`s seeded by
    (the sampler's seed, its epoch, the index). Read at each pass, so `set_epoch` on `sampler` holds."""

    def __init__(self, sampler: ResumableSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        s = self.sampler
        return (Draw(i, draw_seed(s.seed, s.epoch, i)) for i in s)

    def __len__(self) -> int:
        return len(self.sampler)
