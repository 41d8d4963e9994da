"""Pipeline stages at different TP degrees on megatron-core's schedules.

``boundary`` (pure): which rows of an activation cross a stage boundary between which ranks;
``p2p``: megatron's ``P2PCommunicator`` moving them; ``finalize``: tied embeddings by vocab
unit, the whole-model grad norm and the loss after the per-stage sync; ``schedule``: one
step's forward/backward through megatron's 1F1B schedule.
"""

from .boundary import boundary_pieces, grad_pieces
from .schedule import PipelineRunner

__all__ = ["PipelineRunner", "boundary_pieces", "grad_pieces"]
