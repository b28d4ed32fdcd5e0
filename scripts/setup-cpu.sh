#!/usr/bin/env bash
# The README's CPU quick start, step 1: .venv with PyTorch and dlenv, on a machine without a GPU.
#
#   bash scripts/setup-cpu.sh          (from the root of a clone; then: . .venv/bin/activate)
#
# Python: the first of python3.10, pyenv's 3.10, then python3.13 / 3.12 / 3.11 / python3 if >= 3.10.
# 3.10 gets the image's pins (environment.yml: torch 1.13.1); a newer Python gets the pins CI's
# "newest" lane tests (.ci/run), as torch 1.13.1 has no wheels beyond 3.10.
# PyTorch: the CPU-only wheels from download.pytorch.org when it answers, else PyPI, said in one line
# (PyPI's Linux wheels carry the CUDA libraries: gigabytes instead of a few hundred MB).
# It ends with the time it took and the size of .venv, and sets up `invoke VERB` for any folder
# (~/.invoke.yaml, written only when you have none).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
CPU_INDEX=https://download.pytorch.org/whl/cpu
IMAGE_PINS="torch==1.13.1 torchvision==0.14.1 torchaudio==0.13.1"
NEWEST_PINS="torch==2.14.1 torchvision==0.29.1"

version_ok() {  # $1 = a python; prints its X.Y when it is 3.10 or newer
  "$1" -c 'import sys; assert sys.version_info >= (3, 10); print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}
find_python() {
  local c p
  for c in python3.10 "$(pyenv root 2>/dev/null)/versions/3.10"*/bin/python python3.13 python3.12 python3.11 python3; do
    p=$(command -v "$c" 2>/dev/null) || continue
    version_ok "$p" >/dev/null && { echo "$p"; return 0; }
  done
  return 1
}
PY=$(find_python) || {
  echo "setup-cpu: no Python 3.10 or newer found; install one (e.g. 'pyenv install 3.10.13', or 'sudo apt-get install python3.10-venv') and run this again" >&2
  exit 2
}
ver=$(version_ok "$PY")
pins=$([ "$ver" = 3.10 ] && echo "$IMAGE_PINS" || echo "$NEWEST_PINS")
echo "setup-cpu: Python $ver ($PY); $pins"

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if .venv/bin/python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/', timeout=10)" 2>/dev/null; then
  echo "setup-cpu: PyTorch's CPU-only wheels from $CPU_INDEX"
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $pins --index-url "$CPU_INDEX"
else
  echo "setup-cpu: $CPU_INDEX cannot be reached from here, so PyTorch comes from PyPI, whose Linux wheels include the CUDA libraries (about 4 GB instead of about 1 GB)"
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $pins
fi
.venv/bin/python -m pip install -q -r requirements-dev.txt -e .
.venv/bin/python -m dlenv.invocation
echo "setup-cpu: done in $(( $(date +%s) - start )) s; .venv takes $(du -sh .venv | cut -f1); next: . .venv/bin/activate"
