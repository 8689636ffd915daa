"""The typed schema of a gaexp run, registered in Hydra's ConfigStore, and the resolvers conf/ uses.

Near the bottom layer: of gaexp it imports only gaexp/machine.py (the CPUs and device its resolvers
report); the docs tables generated from it are gaexp/configdocs.py's. The YAML files in conf/ extend these
dataclasses, so OmegaConf checks types, required and unknown keys when Hydra composes; each
key's range is declared beside it (`valid=`) and checked by `__post_init__`, which runs when
`typed(cfg)` turns the composed config into objects, before anything is recorded.

Every key is declared once here, with its default, help and range. A key marked `runtime` says where
and how a run executes and cannot change its result beyond rounding (`compile` and `threads` may
round differently); every other key is protocol. From that one mark come the protocol key that
resume matches (`protocol_part`), the keys Hydra leaves out of sweep folder names
(`${gaexp.runtime_keys:}`) and the columns the analysis refuses to pool across (`PROTOCOL_COLUMNS`).

The wing, bottom up: keys (how a key is declared and checked), schema (the dataclasses), protocol (what the
runtime mark derives), overrides (the command line before Hydra), resolvers (registration). `gaexp.config` names
each module's public names.
"""

from gaexp.config.keys import Rule, at_least, number, one_of, NOT_ADDED, key, node, require, INT64, Checked
from gaexp.config.schema import (HOLDOUT_SEED, CONFIG_DIR, AXES, PRESET_GROUPS, NormConfig, GroupNormConfig,
                                 PreciseBNConfig, MicroEvalBNConfig, BatchRenormConfig, KMomentumBNConfig,
                                 CustomNormConfig, NORM_SCHEMAS, REGIME_NAME, regime_name, parse_regime,
                                 RegimeConfig, AUTOCASTS, WEIGHTS, ACCUMULATE_IN, FP32, precision_name,
                                 PrecisionConfig, TrainConfig, PathsConfig, DATA_SOURCES, DATA_KINDS, AUGMENTS, TaskConfig, TASKS,
                                 TASK_LOSSES,
                                 PypiSource, DebianSource, DataConfig, ModelConfig, OptunaTrialConfig,
                                 EXPERIMENT_NAME_MAX, NAME_MAX, TRACKING_URI, MlflowConfig, OBJECTIVES,
                                 AnalysisConfig, DEVICES, MAX_THREADS, THREADS, COMPILE_CHOICES, ENGINES,
                                 LOOP, BATCHED, CACHED,
                                 AUTO_ENGINE, CELLS, Config, schema_leaves, ADDED_DEFAULTS)
from gaexp.config.protocol import (check_keys, typed, leaves, OBJECTIVE_KEYS, runtime_keys, PROTOCOL_COLUMNS,
                                   protocol_part, resolved_value)
from gaexp.config.overrides import (GROUPS, unknown_choice, HYDRA_FLAGS, hydra_overrides, sweep_cases, swept_cells,
                                    compose_config, composition_problem, rest_value, FAILED_MARKER, job_config)
from gaexp.config.resolvers import register

__all__ = ["Rule", "at_least", "number", "one_of", "NOT_ADDED", "key", "node", "require", "INT64", "Checked",
           "HOLDOUT_SEED", "CONFIG_DIR", "AXES", "PRESET_GROUPS", "NormConfig", "GroupNormConfig", "PreciseBNConfig",
           "MicroEvalBNConfig", "BatchRenormConfig", "KMomentumBNConfig", "CustomNormConfig", "NORM_SCHEMAS",
           "REGIME_NAME", "regime_name", "parse_regime", "RegimeConfig", "AUTOCASTS", "WEIGHTS", "ACCUMULATE_IN",
           "FP32", "precision_name", "PrecisionConfig", "TrainConfig", "PathsConfig", "DATA_SOURCES", "DATA_KINDS",
           "TaskConfig", "TASKS", "TASK_LOSSES",
           "AUGMENTS", "PypiSource", "DebianSource", "DataConfig", "ModelConfig", "OptunaTrialConfig",
           "EXPERIMENT_NAME_MAX", "NAME_MAX", "TRACKING_URI", "MlflowConfig", "OBJECTIVES", "AnalysisConfig",
           "DEVICES", "MAX_THREADS", "THREADS", "COMPILE_CHOICES", "ENGINES", "LOOP", "BATCHED", "CACHED", "AUTO_ENGINE", "CELLS", "Config",
           "schema_leaves", "ADDED_DEFAULTS", "check_keys", "typed", "leaves", "OBJECTIVE_KEYS", "runtime_keys",
           "PROTOCOL_COLUMNS", "protocol_part", "resolved_value", "GROUPS", "unknown_choice", "HYDRA_FLAGS",
           "hydra_overrides", "sweep_cases", "swept_cells", "compose_config", "composition_problem", "rest_value",
           "FAILED_MARKER", "job_config", "register"]
