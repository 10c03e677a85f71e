# syntax=docker/dockerfile:1
# ntil-ds training image: CUDA 13.0, torch / DeepSpeed (FusedAdam + CPUAdam prebuilt) / flash-attn /
# bitsandbytes / transformers / MLflow at the project's pins. How to build, run, convert for enroot or
# apptainer, and use from SLURM: docs/container.md.
#
#   docker build -t ntil-ds:0.1.0 --build-arg TORCH_CUDA_ARCH_LIST="9.0" .
#
# The same file, with build args only, makes a CPU variant (Debian 12, Python 3.11, torch's CPU build,
# no CUDA ops, no flash-attn / liger-kernel): the same stages, files, entry point, user and layout.
# `make container-test` builds it with buildah and trains in it (docker/container_test.sh; the build
# args: docs/container.md, "The CPU variant, built and run here").
#
# Versions: no Python package version is written in this file. pip reads them from
# constraints/cpu.txt (the same pins CI uses: torch, deepspeed, transformers, accelerate, mlflow,
# bitsandbytes ...) and constraints/cuda.txt (GPU-only: flash-attn, the CUDA wheels torch pulls).
#
# Base: NVIDIA's CUDA devel image to compile (nvcc for DeepSpeed ops and flash-attn), CUDA base image
# to run (the torch wheel ships cuBLAS/cuDNN/NCCL itself); not NGC PyTorch, whose own torch build cannot
# be pinned to the project's torch (docs/container.md, "Why this base").
# CUDA_VERSION's major.minor must be the CUDA that the pinned torch was built for (PyPI torch 2.13.0:
# 13.0): DeepSpeed's op builder refuses any other, and verify_stack.py stops the build at once if not.
# CUDA_VERSION=none: a CPU image, whose torch must be the CPU build (with it: CPU bases, PYTHON,
# DS_ACCELERATOR=cpu, DS_BUILD_FUSED_ADAM=0, CUDA_KERNELS=0).
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04
ARG BUILD_BASE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}
ARG RUNTIME_BASE=nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}
# The base's Python package (PYTHON, PYTHON-dev, PYTHON-venv): Ubuntu 24.04's is 3.12, Debian 12's 3.11.
ARG PYTHON=python3.12
# 0: without the CUDA-only kernel packages flash-attn and liger-kernel (Triton); the CPU variant.
ARG CUDA_KERNELS=1

# ---------------------------------------------------------------------------------------------------
FROM ${BUILD_BASE} AS build
ARG CUDA_VERSION
ARG PYTHON
ARG CUDA_KERNELS
# GPU architectures to compile for: 8.0 A100, 8.6/8.9 L40/RTX, 9.0 H100/H200, 10.0 B200. Fewer = faster
# build; +PTX adds code that newer GPUs JIT-compile.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0+PTX"
# Parallel nvcc jobs for the flash-attn source build: each takes up to ~9 GB of RAM (x NVCC_THREADS).
ARG MAX_JOBS=4
ARG NVCC_THREADS=2
# TRUE skips flash-attn's download of a prebuilt wheel from its GitHub release and compiles it.
ARG FLASH_ATTENTION_FORCE_BUILD=FALSE
# The accelerator DeepSpeed's ops are built for (cpu for the CPU variant), and which ops are prebuilt.
ARG DS_ACCELERATOR=cuda
ARG DS_BUILD_FUSED_ADAM=1
ARG DS_BUILD_CPU_ADAM=1
# The CPU accelerator's shared-memory collectives (the CPU variant prebuilds them; CUDA has no such op).
ARG DS_BUILD_SHM_COMM=0
# Empty: torch from PyPI (CUDA 13.0). For another CUDA, e.g. https://download.pytorch.org/whl/cu129
# together with CUDA_VERSION=12.9.1 (the cu13 pins of constraints/cuda.txt then do not apply).
ARG TORCH_INDEX_URL=""
# ARG, not ENV: apt's non-interactive mode is for the build, not for users of the image.
ARG DEBIAN_FRONTEND=noninteractive

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# SHELL after the stage's last ARG/ENV: hadolint 2.15 forgets it across them (hadolint#1252).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The base's release (UBUNTU_VERSION, inside the base tag) fixes these packages' versions; pinning
# Debian revisions here would break the build whenever Ubuntu publishes a security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "$PYTHON" "$PYTHON-dev" "$PYTHON-venv" g++ git \
    && rm -rf /var/lib/apt/lists/*

RUN "$PYTHON" -m venv /opt/venv

WORKDIR /build
COPY constraints/ constraints/
COPY docker/verify_stack.py docker/

# DL3013 (pin versions in pip) is ignored where `pip install` names packages without versions: the
# versions come from the -c constraints files, and verify_stack.py fails the build if any installed
# package differs from its pin.
# 1. torch, and the build tools the --no-build-isolation builds below need (they must see this torch).
# hadolint ignore=DL3013
RUN pip install -c constraints/cpu.txt -c constraints/cuda.txt \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        torch setuptools wheel packaging psutil ninja einops \
    && python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
        --require torch --cuda "$CUDA_VERSION"

# 2. DeepSpeed with its ops compiled now. DS_ACCELERATOR=cuda: no GPU is visible during a build,
#    and DeepSpeed would otherwise pick its CPU accelerator and build nothing for CUDA.
#    CPUAdam is compiled with -march=native of the build machine: build on a CPU no newer than the
#    cluster's (docs/container.md), or set DS_BUILD_CPU_ADAM=0 to JIT it on the node at first use.
# hadolint ignore=DL3013
RUN ops=(); \
    if [[ "$DS_BUILD_FUSED_ADAM" == 1 ]]; then ops+=(fused_adam); fi; \
    if [[ "$DS_BUILD_CPU_ADAM" == 1 ]]; then ops+=(cpu_adam); fi; \
    if [[ "$DS_BUILD_SHM_COMM" == 1 ]]; then ops+=(deepspeed_shm_comm); fi; \
    DS_ACCELERATOR="$DS_ACCELERATOR" DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM="$DS_BUILD_FUSED_ADAM" \
        DS_BUILD_CPU_ADAM="$DS_BUILD_CPU_ADAM" DS_BUILD_SHM_COMM="$DS_BUILD_SHM_COMM" \
        TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
        pip install -c constraints/cpu.txt -c constraints/cuda.txt --no-build-isolation deepspeed \
    && python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt --require deepspeed \
        --deepspeed-accelerator "$DS_ACCELERATOR" --deepspeed-ops "${ops[@]}"

# 3. flash-attn: its setup first downloads the release wheel built for this torch major.minor, CUDA
#    major, C++11 ABI and Python; if there is none it compiles for FLASH_ATTN_CUDA_ARCHS (its own
#    spelling of TORCH_CUDA_ARCH_LIST: 8.x -> 80, 9.0 -> 90, ...). Importing it then catches a wheel
#    built for another torch / CUDA / C++ ABI ("undefined symbol"). CUDA_KERNELS=0 skips this step.
# hadolint ignore=DL3013
RUN if [[ "$CUDA_KERNELS" != 1 ]]; then echo "no flash-attn (CUDA_KERNELS=$CUDA_KERNELS)"; exit 0; fi; \
    FLASH_ATTN_CUDA_ARCHS="$(sed -E 's/[ ;]+/\n/g' <<<"$TORCH_CUDA_ARCH_LIST" \
        | sed -E 's/\+PTX//; s/^([0-9]+)\..*$/\10/' | sort -n -u | paste -sd ';')" \
    && export FLASH_ATTN_CUDA_ARCHS \
    && MAX_JOBS="$MAX_JOBS" NVCC_THREADS="$NVCC_THREADS" \
        FLASH_ATTENTION_FORCE_BUILD="$FLASH_ATTENTION_FORCE_BUILD" \
        pip install -c constraints/cpu.txt -c constraints/cuda.txt --no-build-isolation flash-attn \
    && python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
        --require flash-attn --import flash_attn

# 4. The project's remaining dependencies (pyproject.toml's list and its gpu extra, less flash-attn and
#    liger-kernel when CUDA_KERNELS=0), at their pins. Only pyproject.toml is copied here, so a source
#    change does not re-run the layers above. Then every installed package but pip must be pinned.
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c 'import os, tomllib; from packaging.requirements import Requirement; \
p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
left_out = set() if os.environ["CUDA_KERNELS"] == "1" else {"flash-attn", "liger-kernel"}; \
wanted = p["dependencies"] + p["optional-dependencies"]["gpu"]; \
print("\n".join(r for r in wanted if Requirement(r).name not in left_out))' > /tmp/project-requirements.txt \
    && pip install -c constraints/cpu.txt -c constraints/cuda.txt -r /tmp/project-requirements.txt \
    && required=(torch deepspeed transformers accelerate mlflow bitsandbytes) \
    && if [[ "$CUDA_KERNELS" == 1 ]]; then required+=(flash-attn); fi \
    && python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
        --require "${required[@]}" --all-pinned-except pip

# ---------------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE} AS runtime
ARG PYTHON
ARG CUDA_KERNELS
ARG USER_UID=1000
ARG USER_GID=1000
ARG DEBIAN_FRONTEND=noninteractive

# Everything a job needs is in ENV, not in the entry point: pyxis/enroot (`srun --container-image`) and
# `apptainer exec` run the given command without the entry point.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    NTIL_HOME=/workspace
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# g++ and the Python headers stay: Triton compiles a small launcher at first use, and a DeepSpeed CPU
# op that was not prebuilt is JIT-compiled with g++ (CUDA ops were prebuilt: there is no nvcc here).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "$PYTHON" "$PYTHON-dev" g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 images ship a user `ubuntu` with uid/gid 1000: drop it so USER_UID=1000 is free for us.
# /workspace is ntil's: a job run without a mounted outputs/ writes there. Made here because who owns
# a folder that WORKDIR makes and `COPY --chown` fills differs between builders (buildah: root).
RUN if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "$USER_GID" ntil \
    && useradd --uid "$USER_UID" --gid "$USER_GID" --create-home --shell /bin/bash ntil \
    && install -d -o "$USER_UID" -g "$USER_GID" /workspace

COPY --from=build /opt/venv /opt/venv

WORKDIR /workspace
COPY --chown=ntil:ntil . /workspace
# Editable, so a checkout bind-mounted over /workspace runs its own code with the image's packages.
# No build isolation: setuptools comes from the pinned venv, nothing is downloaded.
RUN pip install --no-deps --no-build-isolation -e . \
    && required=(torch deepspeed transformers accelerate mlflow bitsandbytes) \
    && if [[ "$CUDA_KERNELS" == 1 ]]; then required+=(flash-attn); fi \
    && python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
        --require "${required[@]}" --all-pinned-except pip ntil-ds --import ntil_ds

# Numeric, so a runtime that cannot read /etc/passwd (Kubernetes runAsNonRoot) still sees non-root.
USER ${USER_UID}:${USER_GID}
ENTRYPOINT ["bash", "/workspace/docker/entrypoint.sh"]
CMD ["help"]
