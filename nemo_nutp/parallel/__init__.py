"""Process groups from a plan, and the per-rank ``ProcessGroupCollection``."""

from .groups import NUTPGroups, build_groups, rank_context

__all__ = ["NUTPGroups", "build_groups", "rank_context"]
