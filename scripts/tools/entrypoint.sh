#!/bin/bash
# The image's entrypoint, run by tini (PID 1): give any user a name and a writable HOME, then become the
# command (exec: tini's signals reach it directly).
#
# With `docker run --user "$(id -u):$(id -g)"` (so files written into the mounted workspace belong to
# you, not root) the UID usually has no entry in /etc/passwd:
#   - Docker sets HOME=/, which is not writable: matplotlib, torch, pip and pytest caches would fail or
#     warn. Such a user gets a private HOME under /tmp.
#   - It has no name: getpass.getuser() raises (torch.compile's inductor calls it, so --compile fails
#     on PyTorch < 2.13). getpass reads LOGNAME and USER before the passwd file, so a name there is
#     enough; /etc/passwd stays root-owned and read-only (making it writable for any UID, as some
#     images do, would let any process of the container add users).
# Files are written with the umask the container was started with; nothing here changes it.
set -euo pipefail
if [ ! -w "${HOME:-/}" ]; then
    HOME="/tmp/home-$(id -u)"
    export HOME
    mkdir -p "$HOME"
fi
if ! name=$(id -un 2>/dev/null); then
    name="user$(id -u)"
fi
export USER="${USER:-$name}" LOGNAME="${LOGNAME:-$name}"

# The project's requirements.txt (dlenv.envcheck.projectreqs): installed into PYTHONUSERBASE, a folder of
# the mounted workspace, under the profile's PyTorch pins, once per change of the file. The hash is
# compared here, so a start with nothing new does not even start Python. A failed install is one line
# (again at each start until the file changes), and the command still runs. At every start the user site is
# checked by content: a distribution of the PyTorch stack there is removed and named. DLENV_REQUIREMENTS=off skips it.
req="${DLENV_WORKSPACE:-/root/workspace}/requirements.txt"
if [ -f "$req" ] && [ -n "${PYTHONUSERBASE:-}" ] && [ "${DLENV_REQUIREMENTS:-on}" != off ]; then
    stamp="$PYTHONUSERBASE/requirements.sha256"
    if [ -f "$stamp" ] && [ "$(sha256sum < "$req" | cut -d' ' -f1)" = "$(cat "$stamp" 2>/dev/null)" ]; then
        if [ -f "$PYTHONUSERBASE/requirements.failed" ]; then
            echo "dlenv: $(head -n 1 "$PYTHONUSERBASE/requirements.failed")" >&2
        fi
        guard=--guard  # the user site lives in the mount: what is there now is checked by content all the same
    else
        guard=--if-changed
    fi
    # not `python -m`: it would put the mounted workspace first on sys.path, and an uploaded folder there
    # named like a module (dlenv/, argparse.py) would run in place of ours at every start. -s: the check
    # itself never imports from the user site it judges. The install is bounded in time (projectreqs).
    if [ "$guard" = --if-changed ] || [ -d "$PYTHONUSERBASE/lib" ]; then
        python -s -c "import sys, runpy; sys.path[:1] == [''] and sys.path.pop(0); sys.argv[1:] = ['$guard']; runpy.run_module('dlenv.envcheck.projectreqs', run_name='__main__', alter_sys=True)" || true
    fi
fi
exec "$@"
