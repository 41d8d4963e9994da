"""Parity on hypothesis-drawn layouts and shapes against stock single-process megatron-core:
degrees per replica, heads / query groups, FFN width, vocab (not divisible by the degrees),
biases, gated or not, tied or not, sequence parallel, RoPE or learned positions, clipping,
optimizer and precision. Each example is one reference spawn and one NUTP spawn (~20-40 s on
two cores), so few examples are drawn; ``derandomize`` keeps CI reproducible while a local run
with ``NUTP_PARITY_EXAMPLES=N`` draws more."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.parity import Case, check_cases, run_cases

EXAMPLES = int(os.environ.get("NUTP_PARITY_EXAMPLES", "3"))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    groups = draw(st.sampled_from([2, 3, 4]))
    heads = groups * draw(st.sampled_from([1, 2]))
    hidden = heads * draw(st.sampled_from([4, 8]))  # even head width (RoPE)
    model: dict[str, Any] = dict(
        hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=draw(st.integers(groups, 3 * hidden)),
        vocab_size=draw(st.integers(40, 130)), gated_linear_unit=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()), add_bias_linear=draw(st.booleans()),
        normalization=draw(st.sampled_from(["RMSNorm", "LayerNorm"])),
        position_embedding_type=draw(st.sampled_from(["rope", "learned_absolute"])))
    replicas = tuple(draw(st.lists(st.integers(1, min(groups, 4)), min_size=1, max_size=3)
                          .filter(lambda r: sum(r) <= 7 and max(r) > 1)))
    precision = draw(st.sampled_from(["fp32", "fp32", "bf16"]))
    optimizer = draw(st.sampled_from(["adam", "sgd"]))
    return Case("drawn", tuple(sorted(replicas, reverse=True)), model,
                global_batch=draw(st.integers(len(replicas), 8)),
                sequence_parallel=draw(st.booleans()),
                sync_layout=draw(st.sampled_from(["refine", "base"])),
                clip_grad=draw(st.sampled_from([0.0, 0.05])), precision=precision,
                optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 1e-3, steps=3)


@pytest.mark.dist
@pytest.mark.timeout(1800)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 3, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_drawn_layouts_match_stock_megatron(case: Case) -> None:
    print(case)
    with tempfile.TemporaryDirectory() as d:
        r = run_cases([case], sum(case.replicas), Path(d))["drawn"]
    check_cases({"drawn": r}, [case])
