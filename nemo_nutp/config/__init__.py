"""Job configuration: dataclass schema (``schema``) + Hydra YAML tree (``configs/``) + CLI
overrides (``loading``); what is computed from a config (``derived``). Every key:
``docs/config.md``, generated from the schema (``docs``)."""

from .derived import cost_spec, fit_cpu_cluster, memory_spec, plan_request
from .loading import compose_config, load_config, schema_keys, validate_yaml_file
from .schema import (
    CheckpointConfig,
    HealthConfig,
    JobConfig,
    ModelConfig,
    NutpConfig,
    OutputConfig,
    RecoveryConfig,
    SyncConfig,
    TrainConfig,
)

__all__ = ["CheckpointConfig", "HealthConfig", "JobConfig", "ModelConfig", "NutpConfig",
           "OutputConfig", "RecoveryConfig", "SyncConfig", "TrainConfig", "compose_config",
           "cost_spec", "fit_cpu_cluster", "load_config", "memory_spec", "plan_request",
           "schema_keys", "validate_yaml_file"]
