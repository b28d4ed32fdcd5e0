"""Synthetic batches already on the device, for speed and memory measurements (`train --synthetic`).

One random batch is made once, in the memory format the model wants, and handed out `length` times:
no decoding, no host-to-device copy, so the measured speed is the model's and the trainer's alone,
the same thing a plain loop over GPU-resident data measures.
"""

from __future__ import annotations

import torch


class SyntheticLoader:
    """An iterable of `length` identical (images, targets) batches on `device`.

    `len()` is `length` like a DataLoader's; `batch_size` and `dataset_size` mirror a real loader's.
    """

    def __init__(self, batch_size: int, img_size: int, num_classes: int, device: torch.device,
                 length: int, memory_format: torch.memory_format = torch.contiguous_format, seed: int = 0):
        g = torch.Generator().manual_seed(seed)  # its own generator: the run's RNG stream is untouched
        images = torch.randn(batch_size, 3, img_size, img_size, generator=g)
        self.images = images.to(device).contiguous(memory_format=memory_format)
        self.targets = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
        self.batch_size = batch_size
        self.length = length
        self.dataset_size = batch_size * length

    def __iter__(self):
        for _ in range(self.length):
            yield self.images, self.targets

    def __len__(self) -> int:
        return self.length
