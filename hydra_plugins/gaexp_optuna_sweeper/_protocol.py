"""A study's protocol: the composed config its trials run with, but the searched, repeated and ignorable keys,
recorded in the study when it is created; continuing the study under another protocol is refused, naming the
keys that differ. Private, so Hydra's plugin scan does not import Optuna in every application."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import optuna
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hydra_plugins.gaexp_optuna_sweeper.config import PROTOCOL, SweeperError


def delete(cfg: DictConfig, dotted: str) -> None:
    """Remove a key (dotted path) from a config, if there."""
    parent, _, last = dotted.lstrip("+~").rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if isinstance(node, DictConfig) and last in node:
        del node[last]


def flatten(tree: Any, prefix: str = "") -> Dict[str, str]:
    if isinstance(tree, dict):
        out: Dict[str, str] = {}
        for k, v in tree.items():
            out |= flatten(v, f"{prefix}{k}.")
        return out or {prefix[:-1]: "{}"}
    return {prefix[:-1]: str(tree)}


def protocol(cell_config: DictConfig, dropped: Sequence[str]) -> Dict[str, str]:
    """A study's identity: every key of its trials' composed config (without `hydra`) and its value as text,
    but the dropped keys (searched, repeated, the trial node, and what the app excludes from a job's
    identity: hydra.job.config.override_dirname.exclude_keys)."""
    ignored = OmegaConf.select(cell_config, "hydra.job.config.override_dirname.exclude_keys", default=None) or []
    cfg = OmegaConf.create(OmegaConf.to_container(cell_config, resolve=False))
    with read_write(cfg), open_dict(cfg):
        for key in ["hydra", *dropped, *ignored]:
            delete(cfg, key)
    hydra_config = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cell_config)  # ${hydra:...} resolves as in the trial's job
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - a value that only resolves in the job: compared as written
        resolved = OmegaConf.to_container(cfg, resolve=False)
    finally:
        if hydra_config is not None:
            HydraConfig.instance().set_config(hydra_config)
    return flatten(resolved)


def check_protocol(study: optuna.Study, storage: str, wanted: Dict[str, str]) -> None:
    """Record a new study's protocol; refuse to continue a study created for another one (or for none)."""
    had = study.user_attrs.get(PROTOCOL)
    new = "start a new study: hydra.sweeper.study_name=<a new name> (or another hydra.sweeper.storage)"
    if had is None:
        if study.trials:
            raise SweeperError(f"study {study.study_name!r} in {storage} has {len(study.trials)} trials and no "
                               f"recorded protocol (made before studies recorded one), so this command's could "
                               f"differ from its trials'; {new}")
        study.set_user_attr(PROTOCOL, wanted)
        return
    differ = sorted(k for k in set(had) | set(wanted) if had.get(k) != wanted.get(k))
    if differ:
        shown = "; ".join(f"{k}: {had.get(k, '(none)')} in the study, {wanted.get(k, '(none)')} here"
                          for k in differ[:4]) + (f"; and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise SweeperError(f"study {study.study_name!r} in {storage} was created for another protocol ({shown}); "
                           f"to continue it, give its values; to ask this question, {new}")
