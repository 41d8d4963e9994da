"""Multi-token prediction through ``nutp-bridge``: the shrunk Qwen3-MoE recipe of
``bridge_moe_jobs`` with ``model.mtp_num_layers=1`` (``MTP``), run by that module's own workers
(Bridge's stock one-process run, ``nutp-bridge`` at [2,1]), each rank also recording the MTP
losses Bridge's ``training_log`` reports (megatron's ``track_mtp_metrics``, ``record_mtp_logs``).

Bridge's stock provider builds its MTP block with Transformer Engine's spec; on CPU (no TE) the
stock run builds megatron's local one (``LocalSpecProvider``: the same math, as its decoder's
local layer spec), with megatron's ``parallel_state`` at TP1/PP1 (what Bridge's MPU path sets
up: megatron's MTP code reads the pipeline rank and data-parallel group from it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MTP = ["model.mtp_num_layers=1", "model.mtp_loss_scaling_factor=0.3"]
"""One MTP layer at a loss scaling factor away from megatron's 0.1 (so the test shows it read)."""


class _Scalars:
    """A writer recording each ``add_scalar`` (and passing it on to Bridge's, if any)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.values: dict[str, float] = {}

    def add_scalar(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.values[name] = float(value)
        if self.writer is not None:
            self.writer.add_scalar(name, value, *args, **kwargs)


def record_mtp_logs() -> list[dict[str, float]]:
    """Each call of megatron's ``track_mtp_metrics`` (Bridge's ``training_log``, once a step)
    appends what it reports: ``mtp_1 loss`` (what it adds to Bridge's ``total_loss_dict``) and
    the acceptance rates it writes."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    logs: list[dict[str, float]] = []
    real = MTPLossLoggingHelper.track_mtp_metrics

    def track(loss_scale: Any, iteration: int, writer: Any, wandb_writer: Any = None,
              total_loss_dict: Any = None) -> None:
        mine: dict[str, Any] = {}
        scalars = _Scalars(writer)
        real(loss_scale, iteration, scalars, wandb_writer, mine)
        logs.append({"iteration": iteration, **{k: float(v) for k, v in mine.items()},
                     **{k: v for k, v in scalars.values.items() if "acceptance" in k}})
        if total_loss_dict is not None:
            for k, v in mine.items():
                total_loss_dict[k] = total_loss_dict.get(k, 0.0) + v

    MTPLossLoggingHelper.track_mtp_metrics = staticmethod(track)  # type: ignore[method-assign]
    return logs


def local_mtp_spec() -> None:
    """Bridge's stock provider builds megatron's local MTP spec (no TE on CPU), with megatron's
    ``parallel_state`` initialised at TP1/PP1 (one process) the first time."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs

    real = gpt_layer_specs.get_gpt_mtp_block_spec

    def spec(config: Any, layer: Any, use_transformer_engine: bool, **kwargs: Any) -> Any:
        if not parallel_state.model_parallel_is_initialized():
            parallel_state._GLOBAL_MEMORY_BUFFER = None  # (the stock run set one: made again)
            parallel_state.initialize_model_parallel(1, 1)
        return real(config, layer, False, **kwargs)

    gpt_layer_specs.get_gpt_mtp_block_spec = spec  # type: ignore[assignment]


def stock_mtp_worker(rank: int, world: int, port: int, overrides: list[str],
                     outdir: str) -> None:
    """``bridge_moe_jobs.stock_worker`` of the recipe with ``MTP``; also writes
    ``mtp_stock_rank0.json`` (the reported MTP losses per step)."""
    from tests.helpers.bridge_moe_jobs import stock_worker

    local_mtp_spec()
    logs = record_mtp_logs()
    stock_worker(rank, world, port, [*MTP, *overrides], outdir)
    Path(outdir, "mtp_stock_rank0.json").write_text(json.dumps(logs))


def nutp_mtp_worker(rank: int, world: int, port: int, overrides: list[str],
                    control: str | None, outdir: str) -> None:
    """``bridge_moe_jobs.nutp_worker`` of the recipe with ``MTP`` at [2,1]; every rank also
    writes ``mtp_nutp_<control>_rank<r>.json``. ``control='mtp_per_rank'`` (negative control):
    each TP rank counts its replica's MTP loss once per TP rank (the scaling factor times the
    degree) and the reported MTP losses are left per replica (NUTP's reduction of megatron's
    tracker, ``bridge_run.mtp_log_callbacks``, off)."""
    import dataclasses

    from nemo_nutp.integrations import bridge_run
    from nemo_nutp.model import moe as nutp_moe
    from tests.helpers.bridge_moe_jobs import nutp_worker

    if control == "mtp_per_rank":
        real = nutp_moe.build_moe_gpt_model

        def build(plan: Any, rank: int, dims: Any, moe: Any, *args: Any, **kwargs: Any) -> Any:
            degree = plan.replicas[plan.rank_index[rank][0]].tp[0]
            moe = dataclasses.replace(
                moe, mtp_loss_scaling_factor=moe.mtp_loss_scaling_factor * degree)
            return real(plan, rank, dims, moe, *args, **kwargs)

        nutp_moe.build_moe_gpt_model = build  # type: ignore[assignment]
        bridge_run.mtp_log_callbacks = lambda *args: None  # type: ignore[assignment]
    logs = record_mtp_logs()
    nutp_worker(rank, world, port, [*MTP, *overrides], control, outdir)
    Path(outdir, f"mtp_nutp_{control}_rank{rank}.json").write_text(json.dumps(logs))
