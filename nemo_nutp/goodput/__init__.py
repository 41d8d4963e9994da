"""Goodput simulator and cost model (``nutp simulate``): failures -> plans -> throughput.

Pure numpy over ``nemo_nutp.layout``; nothing here imports torch or megatron.
"""

from .config import POLICIES, SimConfig, load_sim_config
from .simulate import make_context, simulate

__all__ = ["POLICIES", "SimConfig", "load_sim_config", "make_context", "simulate"]
