"""Hypothesis strategies for model shapes, clusters and failures (shared by layout tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from nemo_nutp.layout import ClusterSpec, HealthReport, ModelDims, ParallelSpec, PlanRequest


@st.composite
def model_dims(draw: st.DrawFn, *, min_units: int = 1, mla: bool = False) -> ModelDims:
    """GQA dims; ``mla``: multi-latent attention dims (one group per head, ``kv_channels =
    v_head_dim``, the latent ranks and head widths drawn; ``q_lora_rank`` possibly None)."""
    groups = draw(st.integers(max(1, min_units), max(1, min_units) + 8))
    hpg = 1 if mla else draw(st.integers(1, 4))
    kv = draw(st.integers(1, 4))
    extra = {}
    if mla:
        extra = dict(kv_lora_rank=draw(st.integers(1, 6)), qk_head_dim=draw(st.integers(1, 4)),
                     qk_pos_emb_head_dim=draw(st.integers(1, 4)), v_head_dim=kv,
                     q_lora_rank=draw(st.one_of(st.none(), st.integers(1, 6))))
    return ModelDims(
        num_layers=draw(st.sampled_from([2, 4, 6])),
        hidden_size=draw(st.integers(2, 12)),
        num_attention_heads=groups * hpg,
        num_query_groups=groups,
        ffn_hidden_size=draw(st.integers(max(1, min_units), max(1, min_units) + 40)),
        vocab_size=draw(st.integers(max(1, min_units), max(1, min_units) + 130)),
        seq_length=draw(st.sampled_from([12, 16, 24, 60])),
        gated_linear_unit=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        add_bias_linear=False if mla else draw(st.booleans()),
        kv_channels=kv, **extra,
    )


def any_model_dims(min_units: int = 1) -> st.SearchStrategy[ModelDims]:
    """GQA or MLA dims (``model_dims``)."""
    return st.one_of(model_dims(min_units=min_units), model_dims(min_units=min_units, mla=True))


@st.composite
def plan_requests(draw: st.DrawFn, policy: str | None = None) -> PlanRequest:
    domain = draw(st.sampled_from([4, 6, 8, 16, 32, 72]))
    tp_base = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6, 8, 16, 32) if d <= domain]))
    n_domains = draw(st.integers(1, 6))
    pp = draw(st.sampled_from([1, 2]))
    num_gpus = domain * n_domains
    dims = draw(model_dims(min_units=tp_base))
    n_fail = draw(st.integers(0, max(0, num_gpus // 4)))
    failed = draw(st.lists(st.integers(0, num_gpus - 1), min_size=n_fail, max_size=n_fail))
    links = draw(st.dictionaries(st.integers(0, num_gpus - 1),  # slow NICs: NIC-aware owners
                                 st.sampled_from([0.25, 0.5, 0.9]), max_size=3))
    return PlanRequest(
        cluster=ClusterSpec(num_gpus=num_gpus, domain_size=domain, gpus_per_node=domain),
        model=dims,
        parallel=ParallelSpec(tp_base=tp_base, pp=pp,
                              sync_layout=draw(st.sampled_from(["refine", "base"])),
                              unit_balance=draw(st.sampled_from(["work", "units"]))),
        global_batch=draw(st.integers(64, 512)),
        health=HealthReport(tuple(failed), slow_links=tuple(links.items())),
        policy=policy or draw(st.sampled_from(["nutp", "drop", "uniform-reduce"])),
    )
