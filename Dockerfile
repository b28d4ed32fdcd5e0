# syntax=docker/dockerfile:1.7
# (1.7: ADD --checksum with build-arg expansion, COPY --chmod; BuildKit is Docker's default builder.)
#
# dlenv: a GPU training image with the conda env `dl` and the dlenv toolkit. One file, two profiles
# (docs/docker.md has both commands and the GPU generations each one serves):
#   default, cu116:  docker build -t dlenv:cu116 .
#   modern, cu128:   docker build -t dlenv:cu128 --build-arg ENV_FILE=environment.modern.yml \
#                      --build-arg TORCH_CUDA=12.8 --build-arg BASE_IMAGE=<the CUDA 12.8 base below> .
#
# The base image is pinned by tag (for people) and digest (for machines: a tag can be re-pushed).
# NVIDIA deletes end-of-life CUDA tags from Docker Hub (CUDA 11 is next in line). To refresh the digest
# while the tag exists, or to keep a copy in a registry of yours before it goes:
#   docker buildx imagetools inspect nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04      (prints "Digest:")
#   docker buildx imagetools create -t <your-registry>/cuda:11.6.2-cudnn8-runtime-ubuntu20.04 \
#       nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04@sha256:<digest>
# and build with --build-arg BASE_IMAGE=<that reference>. The digests here were taken from public build
# logs of these tags (the 11.6.2 one from May 2025); this repository's machines cannot reach Docker Hub
# to re-check them, so run the inspect command above when a pull by digest fails.
#   modern base: nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04@sha256:59e0e4376a0f16d10b03d3a14344b80a866a1674cb4948cb318291387ac05010
ARG BASE_IMAGE=nvidia/cuda:11.6.2-cudnn8-runtime-ubuntu20.04@sha256:ea2af6ed2bc770f83ed30235f7369b8c83a49b58cdb0bfd55f1227d89edfad8f

# ---------------------------------------------------------------------------------------------------
# builder: Miniforge and the `dl` env in /opt/conda. Built on the same base as the runtime so the env's
# binaries meet the very glibc they will run with; only /opt/conda leaves this stage (the installer,
# pip's cache and conda's package tarballs stay behind).
FROM ${BASE_IMAGE} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Miniforge: conda with conda-forge as its only channel, so no Anaconda defaults channel (whose terms of
# service need an acceptance an unattended build cannot give). Version and checksum change together:
# take both from https://github.com/conda-forge/miniforge/releases (the .sha256 file beside the .sh).
ARG MINIFORGE_VERSION=24.11.3-0
ARG MINIFORGE_SHA256=2e1ad2188fe69fcdd522c2b20c08c800a5c7411b775eca768318b1540ed32e53
ADD --checksum=sha256:${MINIFORGE_SHA256} \
    https://github.com/conda-forge/miniforge/releases/download/${MINIFORGE_VERSION}/Miniforge3-${MINIFORGE_VERSION}-Linux-x86_64.sh \
    /tmp/miniforge.sh

# Strict channel priority: a package the pytorch or nvidia channel has is never taken from conda-forge
# (conda-forge has its own, incompatible pytorch and CUDA builds). tini, the image's PID 1, lives in the
# base env so the `dl` env holds only what training needs. Clean in the same RUN, or the layer keeps it.
RUN bash /tmp/miniforge.sh -b -p /opt/conda \
    && rm /tmp/miniforge.sh \
    && /opt/conda/bin/conda config --system --set channel_priority strict \
    && /opt/conda/bin/conda install --yes --name base tini=0.19.0 \
    && /opt/conda/bin/conda clean -afy

# Only the env file and requirements.txt: editing the package or the tests never rebuilds the env.
# requirements.txt sits beside the env file because conda runs pip in the env file's folder (`-r`).
ARG ENV_FILE=environment.yml
COPY ${ENV_FILE} requirements.txt /tmp/env/
RUN /opt/conda/bin/conda env create --name dl --file "/tmp/env/${ENV_FILE}" \
    && /opt/conda/bin/conda clean -afy \
    && rm -rf /tmp/env

# ---------------------------------------------------------------------------------------------------
# runtime: the CUDA base plus /opt/conda, the toolkit and its tests.
FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG BASE_IMAGE
ARG ENV_FILE=environment.yml
# The CUDA version torch must be built for: 11.6 for environment.yml, 12.8 for environment.modern.yml.
ARG TORCH_CUDA=11.6

LABEL org.opencontainers.image.title="dlenv" \
      org.opencontainers.image.description="GPU training environment for image classifiers: conda env dl with PyTorch and the dlenv toolkit" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      dlenv.env-file="${ENV_FILE}" \
      dlenv.torch-cuda="${TORCH_CUDA}"

# The `dl` env's bin first: `docker run IMAGE invoke ...` uses it without `conda activate`; conda itself
# and tini come after it. NVIDIA_*: which GPUs and driver parts the NVIDIA runtime mounts (compute for
# CUDA, utility for nvidia-smi). DLENV_IMAGE turns on the tests marked `image`; DLENV_ENV_FILE tells
# verify-env which profile's pins to compare with. MPLBACKEND: plots render without a display.
ENV PATH=/opt/conda/envs/dl/bin:/opt/conda/bin:${PATH} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DLENV_IMAGE=1 \
    DLENV_ENV_FILE=/opt/dlenv/${ENV_FILE} \
    PYTHONUNBUFFERED=1 \
    MPLBACKEND=Agg

COPY --from=builder /opt/conda /opt/conda

# Fail the build, not the first training run, when the solver picked a CPU build of torch or one for
# another CUDA (torch.version.cuda is None for CPU builds), or when NumPy and OpenCV don't load with it.
RUN python -c 'import os, sys, numpy, torch, torchvision, torchaudio, cv2; \
got, want, env_file = torch.version.cuda, os.environ["TORCH_CUDA"], os.environ["DLENV_ENV_FILE"]; \
torch.from_numpy(numpy.zeros(2)); \
print(f"torch {torch.__version__} (CUDA {got}), torchvision {torchvision.__version__}, torchaudio {torchaudio.__version__}, numpy {numpy.__version__}, opencv {cv2.__version__}"); \
sys.exit(None if got == want else f"torch {torch.__version__} is built for CUDA {got}, not {want}: the solver picked a CPU build or another CUDA; check {env_file}")'

# `conda activate dl` in every interactive bash (any user: /etc/bash.bashrc, not only /root/.bashrc).
# /root readable by all: with `docker run --user UID:GID` invoke must still reach /root/workspace and
# find /root/tasks.py above it.
RUN printf '\n# dlenv: the dl env in interactive shells\n. /opt/conda/etc/profile.d/conda.sh && conda activate dl\n' \
        >> /etc/bash.bashrc \
    && chmod 755 /root

COPY --chmod=755 scripts/entrypoint.sh /usr/local/bin/dlenv-entrypoint

# Late layers, rebuilt on code edits in seconds: the project template, the tasks file and the package.
# invoke looks for tasks.py from the working directory upwards, so /root/tasks.py is found from
# /root/workspace also when a user's project is mounted over it.
COPY workspace/ /root/workspace/
COPY tasks.py /root/tasks.py
# .dockerignore lets through only the package, its tests, the env files and docs (the tests are run by
# `invoke test` from /opt/dlenv/tests).
COPY . /opt/dlenv/
WORKDIR /root/workspace
# Editable, so `invoke test` finds /opt/dlenv/tests beside the package; --no-deps: the env has them all.
# Then prove the tasks are found from the workspace (grep without -q reads all, so invoke gets no SIGPIPE).
RUN pip install --no-cache-dir --no-deps -e /opt/dlenv \
    && dlenv --version \
    && invoke --list | grep verify-env

# tini as PID 1 reaps zombies (DataLoader workers) and passes Ctrl-C / docker stop on; -g sends them to
# the whole process group, so workers stop with the trainer.
ENTRYPOINT ["/opt/conda/bin/tini", "-g", "--", "/usr/local/bin/dlenv-entrypoint"]
CMD ["bash"]
