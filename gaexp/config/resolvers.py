"""Registration: the schema in Hydra's ConfigStore and the `${gaexp.*}` resolvers conf/ uses.
"""

import math
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from gaexp.config.protocol import OBJECTIVE_KEYS, runtime_keys
from gaexp.config.schema import Config, NORM_SCHEMAS, PRESET_GROUPS, precision_name
from gaexp.machine import device_type, usable_cores


def register() -> None:
    """The schema in Hydra's ConfigStore (`gaexp_schema`, and `schema/norm/<kind>` for the norm files),
    and the resolvers:
    `${gaexp.abspath:outputs/x}`: an absolute path, so stores and data roots never depend on a job's folder.
    `${gaexp.cores:}`: the CPUs this process may use. `${gaexp.device_type:auto}`: cpu or cuda, here. `${gaexp.div:a,b}`: a // b, at least 1. `${gaexp.given:x}`: whether x is set (not null).
    `${gaexp.mul:a,b}`: a product (the effective batch size b x k).
    `${gaexp.runtime_keys:}`: the runtime keys and preset groups, for hydra.job.config.override_dirname (which
    the Optuna sweeper also reads: keys that do not make a study another question), but the objective's keys."""
    store = ConfigStore.instance()
    store.store(name="gaexp_schema", node=Config)
    for kind, schema in NORM_SCHEMAS.items():
        store.store(group="schema/norm", name=kind, node=schema)
    resolvers = {
        "gaexp.abspath": lambda p: str(Path(p).expanduser().resolve()),
        "gaexp.cores": usable_cores,
        "gaexp.device_type": device_type,
        "gaexp.div": lambda a, b: max(1, a // b),
        "gaexp.given": lambda value: value is not None,
        "gaexp.mul": lambda *xs: math.prod(xs),
        "gaexp.precision_name": precision_name,
        "gaexp.runtime_keys": lambda: [*PRESET_GROUPS, *(k for k in runtime_keys() if k not in OBJECTIVE_KEYS)],
    }
    for name, resolver in resolvers.items():
        OmegaConf.register_new_resolver(name, resolver, replace=True)
