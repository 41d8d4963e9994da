"""nemo_nutp: non-uniform tensor parallelism for Megatron-Core."""

__version__ = "0.1.0"
