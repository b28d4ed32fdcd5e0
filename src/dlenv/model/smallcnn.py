"""`--model small_cnn`: a four-block CNN small enough to train in minutes on a laptop's CPU.

Each block is conv 3x3 - BatchNorm - ReLU - max-pool 2x2, at width, 2x, 4x and 8x channels, then global
average pooling and a linear head (about 390k parameters at width 32). It is what the demo trains on
a machine without a GPU (dlenv.data.demo.cpu_recipe): ResNet-18 at the demo's sizes needs several
times the CPU time per epoch and more epochs (docs/benchmarks.md has the measurements). The blocks are
listed in `checkpoint_blocks`, so --checkpoint finds them.
"""

from __future__ import annotations

from torch import nn

#: the --model name
NAME = "small_cnn"


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU-maxpool blocks (width, 2x, 4x, 8x channels), global average pooling, linear."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        chans = [3, width, 2 * width, 4 * width, 8 * width]
        self.blocks = nn.Sequential(*(nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.MaxPool2d(2)) for cin, cout in zip(chans[:-1], chans[1:], strict=True)))
        self.head = nn.Linear(chans[-1], num_classes)
        self.checkpoint_blocks = list(self.blocks)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))
