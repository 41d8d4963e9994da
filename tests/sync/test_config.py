"""``sync:`` config: bucket size and the gradient-reduction dtype, which is one knob with two
names (``sync.grad_reduce_dtype`` and megatron's ``train.grad_reduce_in_fp32``)."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_nutp.config.schema import load_config


@pytest.mark.parametrize("overrides, dtype, in_fp32", [
    ([], "fp32", True),
    (["train.precision=bf16"], "fp32", True),
    (["train.precision=bf16", "sync.grad_reduce_dtype=bf16"], "bf16", False),
    (["train.precision=bf16", "train.grad_reduce_in_fp32=false"], "bf16", False),
    (["train.precision=bf16", "sync.grad_reduce_dtype=fp32"], "fp32", True),
    (["train.grad_reduce_in_fp32=false"], "fp32", True),  # fp32 params reduce in fp32 anyway
])
def test_grad_reduce_dtype_is_an_alias(overrides: list[str], dtype: str, in_fp32: bool) -> None:
    cfg = load_config(overrides)
    assert cfg.sync.grad_reduce_dtype == dtype
    assert cfg.train.grad_reduce_in_fp32 is in_fp32
    again = dataclasses.replace(cfg, nutp=cfg.nutp)  # re-validation keeps the resolved pair
    assert (again.sync.grad_reduce_dtype, again.train.grad_reduce_in_fp32) == (dtype, in_fp32)


@pytest.mark.parametrize("overrides, field", [
    (["train.precision=bf16", "train.grad_reduce_in_fp32=false", "sync.grad_reduce_dtype=fp32"],
     "sync.grad_reduce_dtype"),
    (["sync.grad_reduce_dtype=bf16"], "sync.grad_reduce_dtype"),  # fp32 params
    (["train.precision=fp16", "sync.grad_reduce_dtype=bf16"], "sync.grad_reduce_dtype"),
    (["sync.grad_reduce_dtype=fp8"], "sync.grad_reduce_dtype"),
    (["sync.bucket_size=0"], "sync.bucket_size"),
])
def test_bad_sync_config_names_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(overrides)


def test_bucket_size_default_is_fixed() -> None:
    from nemo_nutp.sync.engine import DEFAULT_BUCKET_SIZE

    assert load_config([]).sync.bucket_size == DEFAULT_BUCKET_SIZE
    assert load_config(["sync.bucket_size=1000"]).sync.bucket_size == 1000
