"""Multi-latent attention at the job loader: ``nutp-train`` (no MoE keys, so no MLA model to build)
refuses ``model.kv_lora_rank`` by name; ``nutp-bridge``'s loader (``load_job(mla=True)``, whose
provider's MoE NUTP builds it on: ``integrations.bridge_run.mla_of``) takes it."""

from __future__ import annotations

import pytest

from nemo_nutp.config.recipes import load_job

MLA = ["model.num_query_groups=8", "model.kv_channels=8", "model.kv_lora_rank=12",
       "model.q_lora_rank=16", "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4",
       "model.v_head_dim=8"]
"""The default model (8 heads) with MLA: one query group per head, kv_channels = v_head_dim."""


def test_nutp_train_refuses_mla_by_name_and_nutp_bridges_loader_takes_it() -> None:
    with pytest.raises(ValueError, match=r"^model\.kv_lora_rank=12: multi-latent attention is "
                                         r"not built in nutp-train yet") as e:
        load_job(MLA)
    assert "\n" not in str(e.value)
    assert load_job(MLA, mla=True).model.kv_lora_rank == 12
