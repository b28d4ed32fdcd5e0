#!/usr/bin/env bash
# The CI image lane's pre-step: the two images this network cannot pull, made here from what it can reach.
#
#   base  dlenv-ci-base:<stamp>  Debian bookworm (debootstrap --variant=minbase from deb.debian.org, then
#                                `docker import`), standing in for nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04
#                                (Docker Hub is not reachable). tini comes from Debian here.
#   env   dlenv-ci-env:<stamp>   /opt/conda/envs/dl without conda (conda's channels are not reachable):
#                                pyenv's Python 3.10 made relocatable, with environment.yml's pins and
#                                requirements-dev.txt installed from PyPI wheels on this host (torch 1.13.1
#                                on PyPI is the CUDA 11.7 build), plus /opt/conda/bin/tini, where the real
#                                builder puts conda-forge's tini.
#
# The Dockerfile takes them through build args (BASE_IMAGE, ENV_IMAGE, ENV_KIND=pip, TORCH_CUDA=11.7), so
# the file that builds for users is the file CI builds. Each image is tagged with a stamp of everything it
# is made from: a second CI run on the same engine finds the tags and skips the work; a fresh engine
# builds both. Prints the two image names as NAME=VALUE lines on stdout (everything else goes to stderr).
#
# Needs root, debootstrap and patchelf (.ci/image-lane installs them), a running engine and `pyenv`.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
docker=${DOCKER:-/usr/bin/docker}
work=${DLENV_CI_IMAGE_WORK:-${DLENV_CI_VENVS:-$HOME/.cache/dlenv-ci}/image}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
py_version=${DLENV_CI_PYTHON:-3.10.13}
prefix=/opt/conda/envs/dl
# (pip runs as root into a staging folder of its own, not the system's: its warning about root is noise)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PIP_ROOT_USER_ACTION=ignore

say() { echo "make-bases: $*" >&2; }
die() { echo "make-bases: $*" >&2; exit 1; }

# What pyenv's Python (built on this Debian) links against, and what the tests and the entrypoint use.
# The last line of the env check below imports each module that needs one of these.
packages=bash,coreutils,procps,tini,libssl3,libsqlite3-0,libffi8,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libuuid1,libgdbm6,libexpat1

stamp_of() { sha256sum "$@" | sha256sum | cut -c1-16; }
have_image() { "$docker" image inspect "$1" >/dev/null 2>&1; }

mkdir -p "$work"

# --- base ----------------------------------------------------------------------------------------------
base=dlenv-ci-base:$(echo "bookworm $packages $mirror" | cat - docker/ci/make-bases.sh | sha256sum | cut -c1-16)
build_base() {
    say "building $base: debootstrap --variant=minbase bookworm from $mirror"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    local rootfs=$work/rootfs
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || die "debootstrap failed; its log: $work/debootstrap.log ($(tail -n 1 "$work/debootstrap.log"))"
    # apt's and dpkg's caches are not part of a base image
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
    tar -C "$rootfs" -c . | "$docker" import -c 'CMD ["bash"]' - "$base" >/dev/null
    rm -rf "$rootfs"
}
# In the background: the base and the env need nothing of each other, and each spends most of its time
# waiting on a download (a fresh machine builds both; the wait below joins them).
base_pid=""
# If the env fails first, the base's build is stopped and waited for: nothing of this script outlives it.
trap 'if [ -n "$base_pid" ]; then kill "$base_pid" 2>/dev/null; wait "$base_pid" 2>/dev/null; fi' EXIT
if have_image "$base"; then
    say "$base is there (cached)"
else
    build_base &
    base_pid=$!
fi

# --- env -----------------------------------------------------------------------------------------------
command -v pyenv >/dev/null || die "pyenv is not installed (the env's Python 3.10 comes from pyenv $py_version)"
src=$(pyenv prefix "$py_version" 2>/dev/null) || die "pyenv has no Python $py_version (pyenv install $py_version)"
env=dlenv-ci-env:$(stamp_of docker/ci/make-bases.sh docker/ci/env-requirements.py environment.yml \
    requirements.txt requirements-dev.txt scripts/tools/lock_env.py | cut -c1-10)-py$py_version
if have_image "$env"; then
    say "$env is there (cached)"
else
    say "building $env: Python $py_version from $src, pins from environment.yml, wheels from PyPI"
    command -v patchelf >/dev/null || die "patchelf is not installed (apt-get install patchelf)"
    stage=$work/stage
    rm -rf "$stage"
    mkdir -p "$stage/opt/conda/envs" "$stage/opt/conda/bin"
    cp -a "$src" "$stage$prefix"
    rm -rf "$stage$prefix/lib/python3.10/test"  # CPython's own test suite: 30 MB nobody runs here
    # Python as CPython installs it, with nothing this host added to its site-packages (a .pth of this
    # machine's, say): an empty site-packages, then pip and setuptools from Python's own bundled wheels.
    site=$stage$prefix/lib/python3.10/site-packages
    rm -rf "$site" && mkdir "$site"
    # Relocatable: every ELF file that finds libpython through the old prefix finds it relative to itself.
    find "$stage$prefix" -type f \( -name '*.so*' -o -perm -u+x \) -print0 | while IFS= read -r -d '' f; do
        rpath=$(patchelf --print-rpath "$f" 2>/dev/null) || continue
        case $rpath in *"$src"*)
            rel=$(realpath --relative-to="$(dirname "$f")" "$stage$prefix/lib")
            patchelf --set-rpath "\$ORIGIN/$rel" "$f" ;;
        esac
    done
    py=$stage$prefix/bin/python3.10
    "$py" -m ensurepip --default-pip >/dev/null
    # (this machine's pip configuration names local indexes that may be missing: pip's warning for each
    # is noise, its errors are not, and its exit status stays pip's)
    "$py" -m pip install -q --no-warn-script-location --upgrade pip "PyYAML>=6,<7" \
        2> >(grep -v '^WARNING: Location' >&2) >&2
    # environment.yml's pins (the conda ones as their PyPI names) and requirements-dev.txt: the same
    # versions the conda build installs, from this host's pip cache when the image-pins lane filled it
    "$py" docker/ci/env-requirements.py environment.yml > "$work/env-requirements.txt"
    # (--upgrade: the newest release each bound allows, as conda's solver picks, not the setuptools that
    # came with pyenv's Python; the Dockerfile's editable install builds with the env's setuptools)
    "$py" -m pip install -q --no-warn-script-location --upgrade -r "$work/env-requirements.txt" \
        -r requirements-dev.txt 2> >(grep -v '^WARNING: Location' >&2) >&2
    # what conda would hold in place (the real builder writes the same file with the same script)
    mkdir -p "$stage$prefix/conda-meta"
    "$py" scripts/tools/lock_env.py pinned environment.yml > "$stage$prefix/conda-meta/pinned"
    # The old prefix, wherever it was written down: sysconfig's build data, python3.10-config, pkg-config,
    # and the #! line of every script (pip wrote this stage's path there).
    grep -rlI --null -e "$src" -e "$stage" "$stage$prefix/bin" "$stage$prefix/lib/pkgconfig" \
        "$stage$prefix"/lib/python3.10/_sysconfigdata_*.py "$stage$prefix"/lib/python3.10/config-3.10-*/ \
        | xargs -0 -r sed -i -e "s|$stage$prefix|$prefix|g" -e "s|$src|$prefix|g"
    left=$(grep -rlI -e "$src" -e "$stage" "$stage$prefix/bin" "$stage$prefix"/lib/python3.10/_sysconfigdata_*.py || true)
    [ -z "$left" ] || die "the old prefix is still written in $(head -n 1 <<<"$left")"
    find "$stage$prefix" -name __pycache__ -prune -exec rm -rf {} +
    # It runs from where it lies now, finding its libraries relative to itself (the image's own tests
    # check the rest inside, on the base's libraries).
    "$py" -c "import torch, torchvision, torchaudio, cv2" || die "the staged env does not import torch (above)"
    cp /usr/bin/tini "$stage/opt/conda/bin/tini"  # the ENTRYPOINT's path; Debian's tini 0.19, as conda-forge's
    tar -C "$stage" -c opt | "$docker" import - "$env" >/dev/null
    rm -rf "$stage"
fi
if [ -n "$base_pid" ]; then
    wait "$base_pid" || { base_pid=""; die "the base image was not built (above)"; }
    base_pid=""
fi
# Older stamps are older inputs: their images only fill the disk (the env is a few GB).
for name in $("$docker" image ls --format '{{.Repository}}:{{.Tag}}' dlenv-ci-base) \
            $("$docker" image ls --format '{{.Repository}}:{{.Tag}}' dlenv-ci-env); do
    [ "$name" = "$base" ] || [ "$name" = "$env" ] || "$docker" rmi "$name" >/dev/null 2>&1 || true
done
echo "BASE_IMAGE=$base"
echo "ENV_IMAGE=$env"
