"""In-memory state movement between layouts (issue #23 item 5): pure move plans
(``relayout.plan``, re-exported here; importing this package does not import torch) and the
torch executor (``relayout.move``: ``move_state``, ``MoveReport``, ``MoveImpossible``)."""

from .plan import (
    MOVE_SPACES,
    REP,
    MovePlan,
    Piece,
    plan_move,
    split_stream,
    stable_replan,
    survivor_rank_map,
)

__all__ = ["MOVE_SPACES", "REP", "MovePlan", "Piece", "plan_move", "split_stream",
           "stable_replan", "survivor_rank_map"]
