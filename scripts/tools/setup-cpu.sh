#!/usr/bin/env bash
# The README's CPU quick start, step 1: .venv with PyTorch and dlenv, on a machine without a GPU.
#
#   bash scripts/tools/setup-cpu.sh          (from the root of a clone; then: . .venv/bin/activate)
#
# Python: the first of python3.10, pyenv's 3.10, then python3.13 / 3.12 / 3.11 / python3 if >= 3.10.
# 3.10 gets the image's pins (environment.yml: torch 1.13.1); a newer Python gets the pins CI's
# "newest" lane tests (.ci/run), as torch 1.13.1 has no wheels beyond 3.10.
# PyTorch: the CPU-only wheels from download.pytorch.org when it answers, else PyPI, said in one line
# (PyPI's Linux wheels carry the CUDA libraries: gigabytes instead of a few hundred MB).
# It ends with the time it took and the size of .venv. It writes nothing outside the clone: `invoke VERB`
# finds this clone's tasks.py from inside it, as invoke does for any project, `dlenv VERB` works from any
# folder while .venv is active, and a project of yours keeps its own tasks.py (set_up_invoke, below,
# also takes out the ~/.invoke.yaml an earlier version wrote).
#
# Sourced (`. scripts/tools/setup-cpu.sh`) it only defines its functions, so tests run set_up_invoke alone.
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

# An earlier setup-cpu.sh wrote ~/.invoke.yaml with dlenv's tasks as invoke's search root for every folder,
# which hid every other project's tasks.py ("No idea what 'hello' is!"). That file is removed when it is
# exactly what it wrote; a file with anything of yours in it is left alone, with the line to take out.
DLENV_INVOKE_HEAD="# written by dlenv (scripts/setup-cpu.sh): \`invoke VERB\` finds dlenv's tasks from any folder;"
set_up_invoke() {
  local config="${HOME:?}/.invoke.yaml" lines=()
  if [ -f "$config" ] && [ ! -L "$config" ]; then
    mapfile -t -n 6 lines < "$config"
    if [ "${#lines[@]}" -eq 4 ] && [ "${lines[0]}" = "$DLENV_INVOKE_HEAD" ] &&
       [ "${lines[1]}" = "# your own tasks: invoke -r . TASK" ] && [ "${lines[2]}" = "tasks:" ] &&
       [[ "${lines[3]}" =~ ^\ \ search_root:\ .*/dlenv/invokeroot$ ]]; then
      rm -f "$config"
      echo "setup-cpu: removed $config, which an earlier setup-cpu.sh wrote: it made invoke load dlenv's tasks in every folder, hiding other projects' tasks.py"
    elif grep -q "dlenv/invokeroot" "$config"; then
      echo "setup-cpu: $config sets invoke's tasks.search_root to dlenv's tasks for every folder, hiding other projects' tasks.py; take that setting out (nothing here needs it)"
    fi
  fi
  echo "setup-cpu: \`dlenv VERB\` works from any folder while .venv is active, \`invoke VERB\` inside this clone; other projects keep their own tasks.py (one without: a tasks.py of one line, from dlenv.tasks import ns, gives it dlenv's verbs through invoke)"
}

main() {
  set -euo pipefail
  cd "$(dirname "$0")/../.."
  local start PY ver pins
  start=$(date +%s)
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
  set_up_invoke
  echo "setup-cpu: done in $(( $(date +%s) - start )) s; .venv takes $(du -sh .venv | cut -f1); next: . .venv/bin/activate"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
