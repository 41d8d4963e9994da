"""nemo_nutp: non-uniform tensor parallelism for Megatron-Core / NeMo."""

from setuptools import find_packages, setup

setup(
    name="nemo_nutp",
    version="0.1.0",
    description="Non-uniform tensor parallelism (NUTP) for Megatron-Core: keep training at "
                "reduced TP when GPUs fail, with exact gradient parity.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["nemo_nutp", "nemo_nutp.*"]),
    install_requires=[
        # Any torch >= 2.4 works; CI installs the local CPU wheel (torch==2.13.0) first so this
        # range never pulls a CUDA build. On GPU clusters the container's torch satisfies it.
        "torch>=2.4",
        # Exactly what CI tests (nemo_nutp/compat/tested.py): 0.17+ need Python >= 3.12.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core==0.19.2; python_version >= '3.12'",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "rich>=13",
        "psutil>=5.9",  # undeclared need of megatron-core's dist_checkpointing
        "numpy>=1.24",
        "pyyaml>=6",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "ruff>=0.6",
                "mypy>=1.10", "nvidia-resiliency-ext>=0.4; python_version < '3.12'"],
        # ft_launcher and its rank monitor (recovery under a launcher, train/elastic.py).
        # Python 3.12: 0.4.1 (what >=0.4 resolves to) breaks `import megatron.core` 0.19.2
        # (dist_checkpointing/strategies/nvrx.py reads its missing __version__); no working
        # version is known there, so it is excluded.
        "resilience": ["nvidia-resiliency-ext>=0.4; python_version < '3.12'"],
        "tensorboard": ["tensorboard>=2.15"],
    },
    entry_points={
        "console_scripts": [
            "nutp=nemo_nutp.launch.nutp_cli:main",
            "nutp-train=nemo_nutp.launch.nutp_train:main",
            "nutp-bridge=nemo_nutp.launch.bridge_cli:main",
        ],
    },
)
