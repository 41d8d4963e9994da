# nemo_nutp on the NGC PyTorch container (Python 3.12, CUDA torch, NCCL, Transformer Engine inside).
#   docker build -t nemo_nutp:dev .                       # default tag below
#   docker build --build-arg PYTORCH_TAG=25.01-py3 --build-arg EXTRAS=dev -t nemo_nutp:dev .
# For Slurm + pyxis: `enroot import dockerd://nemo_nutp:dev` (or push to a registry) and pass
# the image to `nutp sbatch --image ...`. The package lives at /opt/nemo_nutp (NUTP_REPO).
ARG PYTORCH_TAG=25.01-py3
FROM nvcr.io/nvidia/pytorch:${PYTORCH_TAG}

# Extras declared in setup.py: test (pytest, hypothesis), dev (test + ruff, mypy, resilience),
# resilience (nvidia-resiliency-ext: ft_launcher for `nutp sbatch --launcher ft_launcher`).
ARG EXTRAS=test,resilience

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /opt/nemo_nutp
COPY . /opt/nemo_nutp

# The image's torch is a CUDA build matched to its NCCL/cuDNN; a PyPI torch would replace it. pip
# does not touch requirements that are already satisfied (setup.py asks torch>=2.4, and pip accepts
# the image's pre-release version string), and the constraints file below turns "some dependency
# wants a different torch / megatron-core" into a resolver error instead of a silent reinstall.
# megatron-core is pinned the same way when the image ships it (the check above made sure it is the
# tested version); otherwise pip installs the tested one from PyPI (setup.py pins it per Python).
# Everything else (hydra-core, omegaconf, rich, ...) is pure Python.
# Fail early, with a clear message, on a base image whose Python or megatron-core is not tested.
RUN python nemo_nutp/compat/tested.py

RUN pip list --format=freeze \
      | grep -iE '^(torch|megatron[-_]core|nvidia[-_]modelopt|transformer[-_]engine)==' \
      > /tmp/image-pins.txt || true; \
    cat /tmp/image-pins.txt; \
    pip install --constraint /tmp/image-pins.txt -e ".[${EXTRAS}]" && \
    python -c "import torch, megatron.core, nemo_nutp; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__)" && \
    nutp --help > /dev/null && nutp-train --help > /dev/null

# Slurm/pyxis tasks start here; mount a results directory and set output.dir to keep outputs.
ENV NUTP_REPO=/opt/nemo_nutp
CMD ["nutp", "--help"]
