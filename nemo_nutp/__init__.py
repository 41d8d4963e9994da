"""nemo_nutp: non-uniform tensor parallelism for Megatron-Core."""

from .common.quiet import filter_notes

# megatron-core's notes that Transformer Engine / Apex are absent, and nvidia-resiliency-ext's
# deprecated ``pynvml`` shim (warns on every ``import torch``): nothing a user can act on.
filter_notes()

__version__ = "0.1.0"
