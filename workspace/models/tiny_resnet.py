"""TinyResNet: a small residual network, an example of training a model of your own with dlenv.

    invoke train --model models/tiny_resnet.py:build --amp --checkpoint
    invoke val --weights runs/exp/best_model.pth

dlenv imports this file (the path is relative to the working folder, /root/workspace in the image)
and calls build(num_classes, **model_args), so `--model-args width=64` makes it wider. `Block`
repeats, so `--checkpoint` finds the blocks by itself; a model built only from torch.nn layers can
name its blocks in a `checkpoint_blocks` attribute instead (see docs/training.md).
"""

import torch
from torch import nn


class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (a 1x1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """A 3x3 stem, three stages of two blocks (width, 2x and 4x channels; the second and third stages
    start by halving the resolution), global average pooling and a linear head."""

    def __init__(self, num_classes: int, width: int = 32, blocks_per_stage: int = 2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                blocks.append(Block(cin, cout, stride=2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean((2, 3)))  # global average pooling


def build(num_classes: int, width: int = 32) -> nn.Module:
    """The factory dlenv calls: build(num_classes, **model_args)."""
    return TinyResNet(num_classes, width)
