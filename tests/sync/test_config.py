"""``sync:`` config: bucket size; the gradient-reduction dtype is ``train.grad_reduce_in_fp32``
(megatron's name), ``sync.grad_reduce_dtype`` its deprecated alias for one release."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from nemo_nutp.config import load_config


@pytest.mark.parametrize("overrides, in_fp32", [
    ([], True),
    (["train.precision=bf16"], True),
    (["train.precision=bf16", "train.grad_reduce_in_fp32=false"], False),
    (["train.grad_reduce_in_fp32=false"], True),  # fp32 params reduce in fp32 anyway
])
def test_grad_reduce_in_fp32(overrides: list[str], in_fp32: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cfg = load_config(overrides)
    assert cfg.train.grad_reduce_in_fp32 is in_fp32
    assert cfg.sync.grad_reduce_dtype is None
    again = dataclasses.replace(cfg, nutp=cfg.nutp)  # re-validation keeps the value
    assert again.train.grad_reduce_in_fp32 is in_fp32


@pytest.mark.parametrize("overrides, in_fp32", [
    (["train.precision=bf16", "sync.grad_reduce_dtype=bf16"], False),
    (["train.precision=bf16", "sync.grad_reduce_dtype=fp32"], True),
])
def test_grad_reduce_dtype_is_a_deprecated_alias(overrides: list[str], in_fp32: bool) -> None:
    with pytest.warns(FutureWarning, match=r"^sync\.grad_reduce_dtype is deprecated: use "
                      r"train\.grad_reduce_in_fp32 ") as record:
        cfg = load_config(overrides)
    assert len([w for w in record if "grad_reduce" in str(w.message)]) == 1
    assert "\n" not in str(record[0].message)
    assert cfg.train.grad_reduce_in_fp32 is in_fp32
    assert cfg.sync.grad_reduce_dtype is None


@pytest.mark.parametrize("overrides, field", [
    (["train.precision=bf16", "train.grad_reduce_in_fp32=false", "sync.grad_reduce_dtype=fp32"],
     "sync.grad_reduce_dtype"),
    (["sync.grad_reduce_dtype=bf16"], "sync.grad_reduce_dtype"),  # fp32 params
    (["train.precision=fp16", "sync.grad_reduce_dtype=bf16"], "sync.grad_reduce_dtype"),
    (["sync.grad_reduce_dtype=fp8"], "sync.grad_reduce_dtype"),
    (["train.precision=fp16", "train.grad_reduce_in_fp32=false"], "train.grad_reduce_in_fp32"),
    (["sync.bucket_size=0"], "sync.bucket_size"),
])
def test_bad_sync_config_names_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(overrides)


def test_contradicting_names_are_one_error_naming_both() -> None:
    with pytest.raises(ValueError, match=r"^sync\.grad_reduce_dtype.*train\.grad_reduce_in_fp32"):
        load_config(["train.precision=bf16", "train.grad_reduce_in_fp32=false",
                     "sync.grad_reduce_dtype=fp32"])


def test_bucket_size_default_is_fixed() -> None:
    from nemo_nutp.sync.engine import DEFAULT_BUCKET_SIZE

    assert load_config([]).sync.bucket_size == DEFAULT_BUCKET_SIZE
    assert load_config(["sync.bucket_size=1000"]).sync.bucket_size == 1000
