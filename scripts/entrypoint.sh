#!/bin/bash
# The image's entrypoint, run by tini (PID 1): give any user a writable HOME, then become the command.
#
# With `docker run --user "$(id -u):$(id -g)"` (so files written into the mounted workspace belong to
# you, not root) the user has no entry in /etc/passwd and Docker sets HOME=/, which is not writable:
# matplotlib, torch, pip and pytest caches would then fail or warn. Such a user gets a private HOME.
set -euo pipefail
if [ ! -w "${HOME:-/}" ]; then
    HOME="/tmp/home-$(id -u)"
    export HOME
    mkdir -p "$HOME"
fi
exec "$@"
