"""Multi-latent attention through ``nutp-bridge``: Bridge's DeepSeek-V3 pretraining recipe
(``RECIPE``, its HF config from the committed stand-in under ``configs/hf/hub``) shrunk by
``tests/integrations/data/bridge_deepseek_v3_tiny.yaml``, run by ``bridge_moe_jobs``' own
workers (Bridge's stock one-process run from NUTP's initial weights; ``nutp-bridge`` at [2,1]).

Bridge's DeepSeek-V3 provider sets megatron's decoder block spec as its layer spec; on CPU (no TE)
the stock run builds megatron's local one with the norms by ``model.normalization``
(``bridge_stock.local_block_spec``). megatron's local MLA spec does not build without TE:
``MLASelfAttention`` passes ``k_channels``/``v_channels`` to a core attention that does not take
them. The stock run's only non-stock piece is therefore the named adapter of the MoE reference,
``mla_reference.MLACoreAttention`` (megatron's ``DotProductAttention`` dropping the two
arguments), as megatron's local core attention (``LocalSpecProvider.core_attention``); the
recipe's ``kv_channels`` is the shrunk ``v_head_dim`` (what that attention sizes its output by).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECIPE = ("megatron.bridge.recipes.deepseek.h100.deepseek_v3:"
          "deepseek_v3_pretrain_1024gpu_h100_bf16_config")
TINY = Path(__file__).resolve().parents[1] / "integrations" / "data" / \
    "bridge_deepseek_v3_tiny.yaml"
CPU = ["optimizer.main_grads_dtype=float32", "optimizer.exp_avg_dtype=float32",
       "optimizer.exp_avg_sq_dtype=float32", "model.persist_layer_norm=false"]
"""The recipe's precision-aware optimizer's bf16 moments and gradients at fp32 (with its switch
off, ``bridge_moe_jobs.CPU``): the parity runs' fp32; its persistent (TE) layer norm off, a
CPU substitution both runs make alike (torch's norm)."""


def use_recipe() -> None:
    """``bridge_moe_jobs``' loader reads this recipe and its shrinking YAML (this process)."""
    from tests.helpers import bridge_moe_jobs

    bridge_moe_jobs.RECIPE = RECIPE
    bridge_moe_jobs.TINY = TINY


def local_mla_core_attention() -> None:
    """megatron's local spec provider gives the named MLA adapter as its core attention (see
    the module doc; for a non-MLA attention it is megatron's ``DotProductAttention``)."""
    from megatron.core.models.backends import LocalSpecProvider

    from tests.helpers.mla_reference import MLACoreAttention

    LocalSpecProvider.core_attention = lambda self: MLACoreAttention  # type: ignore[method-assign]


YARN_ATTRS = ("rotary_base", "scaling_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
"""What megatron's ``YarnRotaryEmbedding`` keeps of MLA's YaRN settings."""


def record_mla_rope() -> list[dict[str, Any]]:
    """Every ``MultiLatentAttention`` built in this process appends what MLA's RoPE and YaRN
    settings made of it: its softmax scale, its rotary embedding's class, settings and output
    at 8 positions (cos/sin angles) and YaRN's mscale; recorded by wrapping the class's
    ``__init__`` (NUTP's ``NUTPMLASelfAttention`` calls it too)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    seen: list[dict[str, Any]] = []
    real = MultiLatentAttention.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        rope = self.rotary_pos_emb
        out = rope(8)
        emb, scale = out if isinstance(out, tuple) else (out, None)
        seen.append({"softmax_scale": float(self.softmax_scale), "rope": type(rope).__name__,
                     **{k: getattr(rope, k, None) for k in YARN_ATTRS},
                     "emb": emb.flatten().tolist(),
                     "emb_mscale": None if scale is None else float(scale)})

    MultiLatentAttention.__init__ = init  # type: ignore[method-assign]
    return seen


def write_first(seen: list[dict[str, Any]], path: Path) -> None:
    """The first MLA layer's record (every layer's is the same: asserted) as JSON."""
    assert seen and all(r == seen[0] for r in seen), len(seen)
    path.write_text(json.dumps(seen[0]))


def stock_mla_worker(rank: int, world: int, port: int, overrides: list[str],
                     outdir: str) -> None:
    """``bridge_moe_jobs.stock_worker`` of the shrunk DeepSeek-V3 recipe (its MTP layer from
    megatron's local MTP spec: ``bridge_mtp_jobs.local_mtp_spec``)."""
    from tests.helpers.bridge_moe_jobs import stock_worker
    from tests.helpers.bridge_mtp_jobs import local_mtp_spec

    use_recipe()
    local_mla_core_attention()
    local_mtp_spec()
    seen = record_mla_rope()
    stock_worker(rank, world, port, [*CPU, *overrides], outdir)
    write_first(seen, Path(outdir, "mla_rope_stock.json"))


def nutp_mla_worker(rank: int, world: int, port: int, overrides: list[str],
                    outdir: str) -> None:
    """In one world of 3 ranks, two runs of ``bridge_moe_jobs.nutp_worker`` (the shrunk
    DeepSeek-V3 recipe at [2,1]; its files ``nutp_<control>.json``), one after the other in the
    same processes (its own ``gloo_rank`` turned into a plain call: the world exists): the run
    itself (control None), then the negative control ``down_unsummed`` for ``CONTROL_STEPS``
    step(s): the MLA down-projections' gradients not summed over the TP group
    (``mla_jobs._unsummed_down_projections``: their weights not marked partial, so each TP rank
    keeps its own sequence shard's part)."""
    from tests.helpers import dist
    from tests.helpers.bridge_moe_jobs import nutp_worker
    from tests.helpers.mla_jobs import _unsummed_down_projections

    use_recipe()
    world_rank = dist.gloo_rank

    def body() -> None:
        dist.gloo_rank = lambda _r, _w, _p, _o, inner: inner()  # type: ignore[assignment]
        try:
            seen = record_mla_rope()
            nutp_worker(rank, world, port, [*CPU, *overrides], None, outdir)
            write_first(seen, Path(outdir, f"mla_rope_nutp_rank{rank}.json"))
            _unsummed_down_projections()
            nutp_worker(rank, world, port,
                        [*CPU, *overrides, f"train.train_iters={CONTROL_STEPS}"],
                        "down_unsummed", outdir)
        finally:
            dist.gloo_rank = world_rank  # type: ignore[assignment]

    world_rank(rank, world, port, outdir, body)


CONTROL_STEPS = 1
"""The negative control's steps (its first step's grad norm already leaves the bound)."""
