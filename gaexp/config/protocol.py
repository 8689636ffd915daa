"""What the runtime mark derives: the composed config typed (unknown and missing keys refused, every range checked),
the schema's leaves, the runtime keys (out of the protocol key and of sweep folder names), the protocol columns the
analysis refuses to pool across, the keys added later with the value older runs had (`ADDED_DEFAULTS`), and the
protocol part of a resolved config that resume matches.
"""

import dataclasses
from typing import Any, Dict, List, Mapping

from omegaconf import DictConfig, OmegaConf

from gaexp.config.schema import ADDED_DEFAULTS, AXES, Config, schema_leaves


def check_keys(node: DictConfig, prefix: str = "") -> None:
    """Refuse keys a schema does not declare. Composition refuses them unless added with `+`, which
    Hydra forces in and OmegaConf.to_object would then silently drop."""
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        valid = [f.name for f in dataclasses.fields(schema)]
        for name in node:
            if name not in valid:
                where = f"norm={node.get('name')}" if prefix == "norm." else prefix.rstrip(".") or "the config"
                raise ValueError(f"{prefix}{name} is not a key of {where}; valid: {', '.join(valid)}")
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_keys(child, f"{prefix}{name}.")


def typed(cfg: DictConfig) -> Config:
    """The composed config as objects: unknown keys and keys left without a value (`???`) are refused, every
    `__post_init__` range check runs."""
    check_keys(cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        helps = {name: f.metadata["help"] for name, f, _ in schema_leaves(Config)}
        name = missing[0]
        raise ValueError(f"{name} has no value; set it on the command line ({name}=...)"
                         + (f": {helps[name]}" if name in helps else ""))
    return OmegaConf.to_object(cfg)


def leaves(runtime: bool) -> List[str]:
    """Dotted keys of the runtime (True) or protocol (False) leaves of Config."""
    return [name for name, _, is_runtime in schema_leaves(Config) if is_runtime == runtime]


OBJECTIVE_KEYS = ("analysis.objective", "analysis.window_start")  # no run's result, but what an Optuna trial returns


def runtime_keys() -> List[str]:
    """Keys that never change a result: out of the protocol key and of sweep folder names."""
    return leaves(runtime=True)


PROTOCOL_COLUMNS = [k for k in leaves(runtime=False) if k.split(".")[0] not in AXES]  # must match to pool


def protocol_part(resolved: Mapping[str, Any]) -> Dict[str, Any]:
    """The resolved config without its runtime keys, without protocol keys added later while at their
    default (runs recorded before them ran so), and without nodes these leave empty."""
    runtime = set(runtime_keys())
    runtime |= {name for name, was in ADDED_DEFAULTS.items() if resolved_value(resolved, name) == was}

    def strip(tree: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
        kept = {}
        for name, value in tree.items():
            dotted = prefix + name
            if dotted in runtime:
                continue
            if isinstance(value, Mapping):
                value = strip(value, dotted + ".")
                if not value and any(k.startswith(dotted + ".") for k in runtime):
                    continue
            kept[name] = value
        return kept

    return strip(resolved, "")


def resolved_value(tree: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree
