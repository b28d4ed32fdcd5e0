"""Three models of a user's own, as the files a mounted project would hold, for the usermodel tests.

- resnet.py: a residual CNN with BatchNorm and dropout; its blocks are attributes, not in a container.
- vit.py: a small transformer with its own block class in a ModuleList, dropout everywhere, a patch
  embedding (so not convolutional), and a factory that takes img_size (default 16).
- named.py: plain torch.nn stages dlenv could not tell apart, named in `checkpoint_blocks`.
CIFAR (cifar.py, written by `write_cifar`) holds factories shaped like kuangliu/pytorch-cifar's.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import textwrap
from pathlib import Path

RESNET = '''
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout2d(0.2)
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.drop(torch.relu(self.bn1(self.conv1(x))))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, num_classes, width):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stage1 = Residual(width, width, 1)
        self.stage2 = Residual(width, 2 * width, 2)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.stage2(self.stage1(self.stem(x)))
        return self.fc(self.drop(x.mean((2, 3))))


def build(num_classes, width=8):
    return ResNet(num_classes, width)
'''

VIT = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=drop, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(drop), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    def __init__(self, num_classes, img_size, depth, drop, patch=4, dim=16, heads=2):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (img_size // patch) ** 2, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, drop) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def build(num_classes, img_size=16, depth=2, drop=0.2):
    return ViT(num_classes, img_size, depth, drop)
'''

NAMED = '''
from torch import nn


def stage(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Dropout2d(0.2), nn.MaxPool2d(2))


class Net(nn.Module):
    def __init__(self, num_classes, width=8):
        super().__init__()
        self.stage1 = stage(3, width)
        self.stage2 = stage(width, 2 * width)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))
        # Only torch.nn layers: nothing marks the stages as blocks, so the model names them.
        self.checkpoint_blocks = ["stage1", "stage2"]

    def forward(self, x):
        return self.head(self.stage2(self.stage1(x)))


def build(num_classes, width=8):
    return Net(num_classes, width)
'''

# Shaped like lucidrains/vit-pytorch's ViT: its patch embedding is LayerNorm, Linear, LayerNorm, which PyTorch
# 1.13's CPU autocast cannot train in bf16 (the Linear hands the second LayerNorm a bf16 input it refuses:
# "expected scalar type BFloat16 but found Float"); 2.x can.
LN_VIT = '''
from torch import nn


class ViT(nn.Module):
    def __init__(self, num_classes=1000, image_size=16, patch=4, dim=16):
        super().__init__()
        patch_dim = 3 * patch * patch
        self.patch = patch
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        n, c, h, w = x.shape
        p = self.patch
        x = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(n, (h // p) * (w // p), p * p * c)
        return self.head(self.to_patch_embedding(x).mean(1))
'''

# Shaped like the files of kuangliu/pytorch-cifar and friends (written for these tests, small): classes
# and functions whose signatures put the class count anywhere but first, or nowhere.
CIFAR = '''
import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class ResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10):
        super().__init__()
        self.layers = nn.Sequential(block(3, 8), *[block(8, 8) for _ in range(num_blocks - 1)])
        self.linear = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.linear(self.layers(x).mean((2, 3)))


def ResNet18():
    return ResNet(BasicBlock, 2)


class DLA(nn.Module):
    def __init__(self, block=BasicBlock, num_classes=10):
        super().__init__()
        self.base = block(3, 8)
        self.linear = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.linear(self.base(x).mean((2, 3)))


cfg = {"VGG11": [8, "M", 8], "VGG13": [8, 8, "M", 8]}


class VGG(nn.Module):
    def __init__(self, vgg_name):
        super().__init__()
        layers, cin = [], 3
        for v in cfg[vgg_name]:
            layers += [nn.MaxPool2d(2)] if v == "M" else [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU()]
            cin = v if v != "M" else cin
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(cin, 10)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class UNetish(nn.Module):
    def __init__(self, n_channels=3, n_classes=2):
        super().__init__()
        self.conv = nn.Conv2d(n_channels, 8, 3, padding=1)
        self.head = nn.Linear(8, n_classes)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def resnet_entry(pretrained=False, **kwargs):
    assert not pretrained, "would download"
    return ResNet(BasicBlock, 1, **kwargs)


def build(width):
    return ResNet(BasicBlock, 1, num_classes=width)
'''


#: file -> (source, blocks apply_checkpointing finds with the default arguments)
MODELS = {"resnet.py": (RESNET, 2), "vit.py": (VIT, 2), "named.py": (NAMED, 2)}


def write_project(root: Path) -> Path:
    """A project folder with models/<the three files>; returns it."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    for name, (source, _) in MODELS.items():
        (root / "models" / name).write_text(source)
    return root


def write(root: Path, rel: str, source: str) -> Path:
    """`source` (dedented) written to `root/rel`, folders made; returns the file."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def one_line(err) -> str:
    """The message of a pytest.raises result, asserted to be one line with no traceback."""
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@contextlib.contextmanager
def isolated_imports(root: Path):
    """Undo what importing a project's files did to sys.path and sys.modules (one process runs many
    projects in the tests; a user's process runs one)."""
    path = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = path
        for name, module in list(sys.modules.items()):
            where = [getattr(module, "__file__", None)]
            if isinstance(getattr(module, "__spec__", None), importlib.machinery.ModuleSpec):
                where += list(module.__spec__.submodule_search_locations or [])
            if any(isinstance(p, str) and p.startswith(str(root)) for p in where):
                del sys.modules[name]


def write_cifar(root: Path) -> Path:
    """models/cifar.py (CIFAR) in the project folder `root`; returns the file."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    path = root / "models" / "cifar.py"
    path.write_text(CIFAR)
    return path
