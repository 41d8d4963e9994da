"""nemo_nutp: non-uniform tensor parallelism for Megatron-Core."""

import warnings

# nvidia-resiliency-ext (ft_launcher) depends on the deprecated ``pynvml`` shim package, which
# warns on every ``import torch``; the NVML bindings it redirects to are the supported ones.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated",
                        category=FutureWarning)

__version__ = "0.1.0"
