"""The image's build check: fail the build, not the first training run, when the env cannot work.

The Dockerfile runs it as soon as the env is in place (`python check_build.py --cuda 11.6`); it needs
no GPU. Each check that fails prints one line with its reason; the exit status is 1 if any failed:

- torch is built for the CUDA the profile expects (torch.version.cuda; None for a CPU build): the
  solver picked a CPU build or one for another CUDA;
- NumPy and torch share memory (torch.from_numpy: a NumPy 2 under torch 1.13 fails here), OpenCV imports;
- torchvision's native library: a JPEG encoded and decoded by torchvision.io (its libjpeg), and
  torchvision.ops.nms (its C++ operators);
- torchaudio's native library: its extension loads and lfilter (a C++ operator on 0.13) runs.

On success it prints one line of versions.
"""

from __future__ import annotations

import argparse
import sys


def check_torch(want_cuda: str, env_file: str) -> str:
    import torch

    got = torch.version.cuda
    if got != want_cuda:
        raise RuntimeError(f"torch {torch.__version__} is built for CUDA {got}, not {want_cuda}: the solver "
                           f"picked a CPU build or another CUDA; check {env_file}")
    return f"torch {torch.__version__} (CUDA {got})"


def check_numpy_opencv() -> str:
    import cv2
    import numpy
    import torch

    t = torch.from_numpy(numpy.arange(4.0))
    if t.sum().item() != 6.0:
        raise RuntimeError(f"torch.from_numpy gave {t.tolist()} for numpy {numpy.__version__}")
    return f"numpy {numpy.__version__}, opencv {cv2.__version__}"


def check_torchvision() -> str:
    import torch
    import torchvision
    from torchvision import io, ops

    image = torch.zeros(3, 16, 16, dtype=torch.uint8)
    image[0] = 200  # a red square: decoded back, red stays far above green
    decoded = io.decode_jpeg(io.encode_jpeg(image))
    if tuple(decoded.shape) != (3, 16, 16) or not decoded[0].float().mean() > decoded[1].float().mean() + 100:
        raise RuntimeError(f"torchvision.io.decode_jpeg returned {tuple(decoded.shape)} with the wrong colours")
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    kept = ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
    if kept != [0, 2]:
        raise RuntimeError(f"torchvision.ops.nms kept boxes {kept}, expected [0, 2]")
    return f"torchvision {torchvision.__version__} (io, ops)"


def check_torchaudio() -> str:
    import torch
    import torchaudio
    import torchaudio.functional as AF

    # 2.x says whether its extension loaded; 0.13 registers its operators when it does
    native = getattr(torchaudio._extension, "_IS_TORCHAUDIO_EXT_AVAILABLE", None)
    if native is None:
        native = hasattr(torch.ops.torchaudio, "_lfilter")
    if not native:
        raise RuntimeError(f"torchaudio {torchaudio.__version__}: its native extension did not load")
    out = AF.lfilter(torch.ones(1, 8), torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]), clamp=False)
    if not torch.allclose(out, torch.full((1, 8), 0.5)):
        raise RuntimeError(f"torchaudio.functional.lfilter returned {out.tolist()}")
    return f"torchaudio {torchaudio.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", required=True, help="the CUDA version torch must be built for, e.g. 11.6")
    parser.add_argument("--env-file", default="the env file", help="named in the message when torch is wrong")
    args = parser.parse_args(argv)
    checks = [lambda: check_torch(args.cuda, args.env_file), check_numpy_opencv, check_torchvision,
              check_torchaudio]
    found, failed = [], []
    for check in checks:
        try:
            found.append(check())
        except Exception as e:  # ImportError, a library that does not load, a wrong result: all fail the build
            failed.append(f"build check: {' '.join(str(e).split()) or e.__class__.__name__}")
    for line in failed:
        print(line, file=sys.stderr)
    if not failed:
        print("build check passed: " + ", ".join(found))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
