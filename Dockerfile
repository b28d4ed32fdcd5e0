# No `# syntax=` line: the Dockerfile frontend built into the engine parses this file, so it builds offline
# and with Docker 20.10's BuildKit (DOCKER_BUILDKIT=1 on 20.10-22.x; the default from 23.0) as with current
# Docker, and no frontend image is pulled. Hence RUN + sha256sum instead of ADD --checksum (1.6+ syntax).
#
# dlenv: a GPU training image with the conda env `dl` and the dlenv toolkit. One file, two profiles
# (docs/docker.md has both commands and the GPU generations each one serves):
#   default, cu116:  docker build -t dlenv:cu116 .
#   modern, cu128:   docker build -t dlenv:cu128 --build-arg ENV_FILE=environment.modern.yml \
#                      --build-arg TORCH_CUDA=12.8 --build-arg BASE_IMAGE=<the CUDA 12.8 base below> .
#   CI, offline:     docker build --network none --build-arg BASE_IMAGE=dlenv-ci-base:<stamp> \
#                      --build-arg ENV_IMAGE=dlenv-ci-env:<stamp> --build-arg ENV_KIND=pip --build-arg TORCH_CUDA=11.7 .
#                    (a Debian base and a pip-built env from docker/ci/make-bases.sh; docs/docker.md, "The CI image lane")
# linux/amd64 and linux/arm64 (docker buildx build --platform linux/arm64 ...): the Miniforge installer
# follows TARGETARCH. On arm64 only the modern profile builds (docs/docker.md, "arm64").
#
# The base image is pinned by tag (for people) and digest (for machines: a tag can be re-pushed).
# NVIDIA deletes end-of-life CUDA tags from Docker Hub (CUDA 11.6 and Ubuntu 20.04 are both past their
# end of life). To refresh the digest while the tag exists, or to keep a copy in a registry of yours:
#   docker buildx imagetools inspect nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04      (prints "Digest:")
#   docker buildx imagetools create -t <your-registry>/cuda:11.6.2-cudnn8-runtime-ubuntu20.04 \
#       nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04@sha256:<digest>
# and build with --build-arg BASE_IMAGE=<that reference>. The digests here were taken from public build
# logs of these tags (the 11.6.2 one from May 2025); this repository's machines cannot reach Docker Hub
# to re-check them, so run the inspect command above when a pull by digest fails.
#   modern base: nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04@sha256:59e0e4376a0f16d10b03d3a14344b80a866a1674cb4948cb318291387ac05010
# When the CUDA 11.6 tag is gone and no copy was kept, the default profile builds on plain Ubuntu:
#   fallback base: --build-arg BASE_IMAGE=ubuntu:22.04
# conda's pytorch-cuda=11.6 brings the CUDA 11.6 runtime libraries itself (and the pytorch channel's
# builds carry cuDNN), so the build check below still proves torch.version.cuda == "11.6"; the host
# driver comes in through the NVIDIA Container Toolkit either way. Pin it by digest as above.
ARG BASE_IMAGE=nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04@sha256:ea2af6ed2bc770f83ed30235f7369b8c83a49b58cdb0bfd55f1227d89edfad8f
# Where /opt/conda comes from: the builder stage below (conda), or an image that holds it (see "env").
ARG ENV_IMAGE=builder

# ---------------------------------------------------------------------------------------------------
# Miniforge, one installer per architecture: conda with conda-forge as its only channel, so no Anaconda
# defaults channel (whose terms of service need an acceptance an unattended build cannot give). Version
# and checksums change together: take them from https://github.com/conda-forge/miniforge/releases (the
# .sha256 file beside each .sh). BuildKit builds only the stage TARGETARCH selects; the builder checks the
# download against its architecture's checksum (`sha256sum -c`) before it runs a byte of it.
ARG MINIFORGE_VERSION=24.11.3-0
ARG MINIFORGE_SHA256_AMD64=2e1ad2188fe69fcdd522c2b20c08c800a5c7411b775eca768318b1540ed32e53
ARG MINIFORGE_SHA256_ARM64=d3f2b771857009ec804faeeef191352186194cb5737a831e55c6347a5f47cb8f

FROM scratch AS miniforge-amd64
ARG MINIFORGE_VERSION
ADD https://github.com/conda-forge/miniforge/releases/download/${MINIFORGE_VERSION}/Miniforge3-${MINIFORGE_VERSION}-Linux-x86_64.sh \
    /miniforge.sh

FROM scratch AS miniforge-arm64
ARG MINIFORGE_VERSION
ADD https://github.com/conda-forge/miniforge/releases/download/${MINIFORGE_VERSION}/Miniforge3-${MINIFORGE_VERSION}-Linux-aarch64.sh \
    /miniforge.sh

# TARGETARCH is set by BuildKit (amd64, arm64) and usable in FROM; the "image" is one of the two stages
# above, which have no tag to pin.
# hadolint ignore=DL3006
FROM miniforge-${TARGETARCH} AS miniforge

# ---------------------------------------------------------------------------------------------------
# builder: Miniforge and the `dl` env in /opt/conda. Built on the same base as the runtime so the env's
# binaries meet the very glibc they will run with; only /opt/conda leaves this stage (the installer,
# pip's cache and conda's package tarballs stay behind).
FROM ${BASE_IMAGE} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Strict channel priority: a package the pytorch or nvidia channel has is never taken from conda-forge
# (conda-forge has its own, incompatible pytorch and CUDA builds). tini, the image's PID 1, lives in the
# base env so the `dl` env holds only what training needs. Clean in the same RUN, or the layer keeps it.
ARG TARGETARCH
ARG MINIFORGE_SHA256_AMD64
ARG MINIFORGE_SHA256_ARM64
RUN --mount=type=bind,from=miniforge,source=/miniforge.sh,target=/tmp/miniforge.sh \
    case "${TARGETARCH}" in arm64) sum="${MINIFORGE_SHA256_ARM64}" ;; *) sum="${MINIFORGE_SHA256_AMD64}" ;; esac \
    && { echo "${sum}  /tmp/miniforge.sh" | sha256sum --check --status - \
         || { echo "the Miniforge installer does not match its sha256 ${sum}: a changed or broken download" >&2; exit 1; }; } \
    && bash /tmp/miniforge.sh -b -p /opt/conda \
    && /opt/conda/bin/conda config --system --set channel_priority strict \
    && /opt/conda/bin/conda install --yes --name base tini=0.19.0 \
    && /opt/conda/bin/conda clean -afy

# Only the env file and requirements.txt: editing the package or the tests never rebuilds the env.
# requirements.txt sits beside the env file because conda runs pip in the env file's folder (`-r`).
# conda-meta/pinned gets every conda pin of the env file (scripts/tools/lock_env.py), so a `conda install`
# inside the image cannot swap Python, PyTorch, NumPy or MKL.
ARG ENV_FILE=environment.yml
COPY ${ENV_FILE} requirements.txt /tmp/env/
RUN --mount=type=bind,source=scripts/tools/lock_env.py,target=/tmp/lock_env.py \
    if [ "${TARGETARCH}" = arm64 ] && [ "${ENV_FILE}" = environment.yml ]; then \
        echo "the default profile (PyTorch 1.13.1, CUDA 11.6) has no linux-aarch64 builds; build arm64 with environment.modern.yml (docs/docker.md, arm64)" >&2; \
        exit 1; \
    fi \
    && /opt/conda/bin/conda env create --name dl --file "/tmp/env/${ENV_FILE}" \
    && /opt/conda/envs/dl/bin/python /tmp/lock_env.py pinned "/tmp/env/${ENV_FILE}" \
        > /opt/conda/envs/dl/conda-meta/pinned \
    && /opt/conda/bin/conda clean -afy \
    && rm -rf /tmp/env

# ---------------------------------------------------------------------------------------------------
# env: where /opt/conda comes from. The builder above, unless ENV_IMAGE names an image that holds a ready
# /opt/conda (CI's image lane, where conda's channels are out of reach, passes its pip-built env: see
# docker/ci/make-bases.sh and docs/docker.md, "The CI image lane"); BuildKit then skips the builder.
# hadolint ignore=DL3006
FROM ${ENV_IMAGE} AS env

# ---------------------------------------------------------------------------------------------------
# runtime: the CUDA base plus /opt/conda, the toolkit and its tests.
FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG BASE_IMAGE
ARG ENV_FILE=environment.yml
# The CUDA version torch must be built for: 11.6 for environment.yml, 12.8 for environment.modern.yml.
ARG TORCH_CUDA=11.6
# How the `dl` env was made: conda (the builder) or pip (an ENV_IMAGE without conda). The lock and the
# shell setup follow it, and the image says it (label, DLENV_ENV_KIND) so its tests know what to expect.
ARG ENV_KIND=conda

LABEL org.opencontainers.image.title="dlenv" \
      org.opencontainers.image.description="GPU training environment for image classifiers: conda env dl with PyTorch and the dlenv toolkit" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      dlenv.env-file="${ENV_FILE}" \
      dlenv.torch-cuda="${TORCH_CUDA}" \
      dlenv.env-kind="${ENV_KIND}"

# The `dl` env's bin first: `docker run IMAGE dlenv ...` uses it without `conda activate`; conda itself
# and tini come after it. NVIDIA_*: which GPUs and driver parts the NVIDIA runtime mounts (compute for
# CUDA, utility for nvidia-smi). DLENV_IMAGE turns on the tests marked `image`; DLENV_ENV_FILE tells
# verify-env which profile's pins to compare with. MPLBACKEND: plots render without a display.
# PYTHONUSERBASE: where a project's requirements.txt installs (the entrypoint, at start, when it changed;
# dlenv.envcheck.projectreqs): a folder of the mounted workspace, one per profile, so it outlasts the
# container; Python finds its site-packages by itself and its scripts come last on PATH.
ENV PATH=/opt/conda/envs/dl/bin:/opt/conda/bin:${PATH}:/root/workspace/.dlenv/cu${TORCH_CUDA}/bin \
    PYTHONUSERBASE=/root/workspace/.dlenv/cu${TORCH_CUDA} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DLENV_IMAGE=1 \
    DLENV_ENV_FILE=/opt/dlenv/${ENV_FILE} \
    DLENV_ENV_KIND=${ENV_KIND} \
    DLENV_TORCH_CUDA=${TORCH_CUDA} \
    PYTHONUNBUFFERED=1 \
    MPLBACKEND=Agg

COPY --from=env /opt/conda /opt/conda

# Fail the build, not the first training run (scripts/tools/check_build.py): a CPU build of torch or one for
# another CUDA, NumPy or OpenCV that don't load with it, torchvision's or torchaudio's native libraries
# missing. Then record the lock in /opt/dlenv/lock: conda's explicit list (URLs and MD5s; a conda env
# without conda fails here, a pip-built env has none), the packages pip installed, and the constraints
# that keep `pip install` from replacing the PyTorch stack (docs/docker.md, "The lock", rebuilds from them).
RUN --mount=type=bind,source=scripts/tools,target=/tmp/scripts \
    python /tmp/scripts/check_build.py --cuda "${TORCH_CUDA}" --env-file "${DLENV_ENV_FILE}" \
    && mkdir -p /opt/dlenv/lock \
    && python /tmp/scripts/lock_env.py conda "${ENV_KIND}" /opt/dlenv/lock/conda-explicit.txt \
    && python /tmp/scripts/lock_env.py pip > /opt/dlenv/lock/pip.txt \
    && python /tmp/scripts/lock_env.py constraints > /opt/dlenv/lock/constraints.txt
ENV PIP_CONSTRAINT=/opt/dlenv/lock/constraints.txt

# `conda activate dl` in every interactive bash (any user: /etc/bash.bashrc, not only /root/.bashrc); a
# pip-built env has no conda, and its bin goes first on PATH instead. /root readable by all: with
# `docker run --user UID:GID` the user must still reach /root/workspace. ($PATH is for bash to expand later.)
# The notebook kernel `dlenv lab` offers is the dl env's Python by its full path, named so in the launcher.
# hadolint ignore=SC2016
RUN if [ "${ENV_KIND}" = conda ]; then \
        line='. /opt/conda/etc/profile.d/conda.sh && conda activate dl'; \
    else \
        line='export PATH=/opt/conda/envs/dl/bin:$PATH'; \
    fi \
    && printf '\n# dlenv: the dl env in interactive shells\n%s\n' "${line}" >> /etc/bash.bashrc \
    && chmod 755 /root \
    && python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (dl)" >/dev/null

COPY --chmod=755 scripts/tools/entrypoint.sh /usr/local/bin/dlenv-entrypoint
# invoke reads /etc/invoke.yaml before it looks for tasks: its search root, /opt/dlenv, makes
# `invoke VERB` reach dlenv's tasks from any folder, whatever tasks.py or tasks/ a mounted project has.
COPY --chmod=644 docker/etc/invoke.yaml /etc/invoke.yaml

# Late layers, rebuilt on code edits in seconds: the project template and the package (with its
# tasks.py and tests; .dockerignore lets through only the package, its tests, scripts, env files and docs).
COPY workspace/ /root/workspace/
COPY . /opt/dlenv/
WORKDIR /root/workspace
# Editable, so `invoke test` finds /opt/dlenv/tests beside the package; --no-deps: the env has them all;
# --no-build-isolation: built with the env's own setuptools, so this step needs no network.
# Then prove the tasks are found from the workspace (grep without -q reads all, so invoke gets no SIGPIPE).
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e /opt/dlenv \
    && dlenv --version \
    && invoke --list | grep verify-env

# `dlenv lab` (JupyterLab) and `dlenv tensorboard`: publish them with docker run -p 8888:8888 -p 6006:6006.
EXPOSE 8888 6006

# tini as PID 1 reaps zombies and passes `docker stop`'s SIGTERM (and a proxied Ctrl-C) on to the command
# alone. Not -g, the whole process group: the DataLoader workers would die first and the trainer would
# fail on them instead of saving last.pth; the trainer stops its workers itself.
ENTRYPOINT ["/opt/conda/bin/tini", "--", "/usr/local/bin/dlenv-entrypoint"]
CMD ["bash"]
