"""Job configuration: dataclass schema + Hydra YAML tree (``configs/``) + CLI overrides."""

from .schema import (
    FailuresConfig,
    JobConfig,
    ModelConfig,
    NutpConfig,
    OutputConfig,
    TrainConfig,
    load_config,
    plan_request,
    schema_keys,
)

__all__ = ["FailuresConfig", "JobConfig", "ModelConfig", "NutpConfig", "OutputConfig",
           "TrainConfig", "load_config", "plan_request", "schema_keys"]
