"""Multi-latent attention through ``nutp-bridge`` (issue #34): Bridge's own DeepSeek-V3
pretraining recipe (its HF config from the committed stand-in, ``configs/hf/hub``), shrunk by
``data/bridge_deepseek_v3_tiny.yaml`` (3 layers, the first dense; 4 heads with a query latent of
16 and a KV latent of 12, head dims 8 + 4 RoPE / 8, the recipe's YaRN; 8 experts top-2 with the
recipe's sigmoid routing, expert bias, group-limited top-k, scaling and sequence aux loss, its
MTP layer; the shared expert at the dense FFN's size, pre-softmax and the shared-expert overlap
off). It trains through Bridge's own ``train()`` with NUTP's MLA (heads as units, the
down-projections and latent norms replicated) and MoE layers at replicas [2,1] with sequence
parallelism, fp32 and clipping on, against Bridge's own stock run of the same recipe in one
process (megatron's ``GPTModel`` from megatron's decoder block spec with the named MLA core
attention adapter, ``bridge_mla_jobs``), from the same initial weights: every step's loss and
grad norm within 1e-5, every rank the same grad-norm bits, the replicas bitwise equal, the
expert biases with the stock run's bits, router flips counted (0).

Negative control (in the test, in the NUTP world after the run, one step): the MLA
down-projections' gradients not summed over the TP group (``bridge_mla_jobs`` control
``down_unsummed``) leaves the grad norm off (2.0e-4)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

TOL = 1e-5



@pytest.mark.timeout(1500)
def test_bridge_deepseek_v3_mla_nutp_2_1_matches_bridge_stock_run(tmp_path: Path) -> None:
    from tests.helpers.bridge_fork import spawn_bridge  # ranks start with Bridge imported
    from tests.helpers.bridge_mla_jobs import nutp_mla_worker, stock_mla_worker
    from tests.helpers.bridge_moe_jobs import check_bridge_parity

    spawn_bridge(stock_mla_worker, 1, ([],), tmp_path)
    stock = json.loads((tmp_path / "stock_rank0.json").read_text())
    spawn_bridge(nutp_mla_worker, 3, ([],), tmp_path)  # the run, then the control, in one world
    got = json.loads((tmp_path / "nutp_None.json").read_text())
    bad = json.loads((tmp_path / "nutp_down_unsummed.json").read_text())

    bad_errs = check_bridge_parity(got, stock, bad, tol=TOL, strict_control=False)
    assert got["bias_equal"], got["bias_max_diff"]
    # MLA's RoPE and YaRN as built: the softmax scale, the rotary embedding and its settings,
    # its angles at 8 positions and YaRN's mscale, the stock run's bits on every NUTP rank
    rope = json.loads((tmp_path / "mla_rope_stock.json").read_text())
    assert rope["rope"] == "YarnRotaryEmbedding" and rope["scaling_factor"] == 40.0, rope
    for r in range(3):
        assert json.loads((tmp_path / f"mla_rope_nutp_rank{r}.json").read_text()) == rope, r
    # the negative control: each TP rank steps the down-projections with its own tokens' part
    assert len(bad["steps"]) == 1 and bad_errs["grad_norm"][0] > TOL, bad_errs


REFUSED = [
    ({"model.num_moe_experts": None, "model.mtp_num_layers": None},
     "model.multi_latent_attention=True: NUTP builds"),
    ({"model.pipeline_model_parallel_size": 2}, "model.pipeline_model_parallel_size=2: not with"),
    ({"model.rope_scaling": True}, "model.rope_scaling=True: not with"),
    ({"model.softmax_scale": 0.5}, "model.softmax_scale=0.5: not with"),
    ({"model.rotary_percent": 0.5}, "model.rotary_percent=0.5: not with"),
    ({"model.rope_type": "llama3"}, "model.rope_type='llama3': must be one of"),
    ({"model.q_lora_rank": None}, "model.q_lora_rank=None: with model.qk_layernorm"),
    ({"model.num_query_groups": 2}, "model.num_query_groups=2: MLA has one per head"),
    ({"checkpoint.save": "/tmp/nutp_h"}, "checkpoint.save=/tmp/nutp_h: not with"),
    ({"optimizer.use_distributed_optimizer": True},
     "optimizer.use_distributed_optimizer=True: not with"),
]
"""What NUTP's MLA does not read or build (the settings changed, the error's start), each
refused in one line naming the field."""


def test_what_nutp_mla_does_not_build_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bridge's shrunk DeepSeek-V3 recipe (loaded once) with one setting changed at a time:
    ``bridge_run.model_config_of`` / ``check_moe`` (``mla_of``, ``check_mla``) refuse it in
    one line naming the field, before any process group; unchanged, it passes."""
    import copy

    from nemo_nutp.integrations.bridge_run import check_moe, model_config_of
    from tests.helpers import bridge_moe_jobs
    from tests.helpers.bridge_mla_jobs import CPU, RECIPE, TINY
    from tests.helpers.bridge_moe_jobs import STOCK, load

    # the loader reads the DeepSeek-V3 recipe in this test only (``use_recipe`` is for the
    # workers' own processes): later tests of this process load the Qwen3-MoE one again
    monkeypatch.setattr(bridge_moe_jobs, "RECIPE", RECIPE)
    monkeypatch.setattr(bridge_moe_jobs, "TINY", TINY)
    cfg = load([*CPU, *STOCK]).bridge
    assert model_config_of(cfg.model, vocab_size=256).kv_lora_rank == 12
    check_moe(cfg)
    for changes, want in REFUSED:
        bad = copy.copy(cfg)
        for field, value in changes.items():
            section, name = field.split(".", 1)
            if getattr(bad, section) is getattr(cfg, section):
                setattr(bad, section, copy.copy(getattr(cfg, section)))
            setattr(getattr(bad, section), name, value)
        with pytest.raises(ValueError) as e:
            model_config_of(bad.model, vocab_size=256)
            check_moe(bad)
        msg = str(e.value)
        assert msg.startswith(want) and "\n" not in msg, (changes, msg)
