"""The command line read before Hydra: an unknown choice or key said in one line (with what is valid, and the likely
meant), the sweep's cells from its overrides, a config composed outside a job, and the config a job is given.
"""

import copy
import difflib
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from gaexp.config.schema import CONFIG_DIR, parse_regime, regime_name


GROUPS = ("task", "model", "norm", "regime", "precision", "data", "launch", "experiment")  # conf/ groups a user names on the command line


def _meaning(group: str, name: str) -> str:
    """The overrides that mean an unknown name where it parses: gn5, w1b4a4."""
    if group == "norm" and re.fullmatch(r"gn\d+", name):
        return f"; for GroupNorm with {name[2:]} groups: norm=gn norm.groups={name[2:]}"
    found = re.fullmatch(r"w(\d+)b(\d+)a(\d+)", name) if group == "regime" else None
    if found and int(found[1]) == 1 and min(map(int, found.groups())) >= 1:  # one replica: no w in its name
        return f"; one replica's name is {regime_name(int(found[2]), int(found[3]))}"
    return ""


def unknown_choice(overrides: Sequence[str], conf: Path = Path(CONFIG_DIR)) -> Optional[str]:
    """One line for the first override naming a file its group does not have (`norm=gn5`), with the valid
    choices and, where the name parses, what it means. None when all are known, or when another search path
    (`hydra.searchpath`) may add files this cannot see."""
    if any(o.lstrip("+").startswith("hydra.searchpath") for o in overrides):
        return None
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or "(" in value or "${" in value:
            continue
        group = key.lstrip("+~")
        if group in GROUPS:
            valid = sorted(p.stem for p in (conf / group).glob("*.yaml"))
            for name in (v.strip() for v in value.split(",")):
                if group == "regime" and parse_regime(name) is not None:
                    continue  # any regime by its name (hydra_plugins/gaexp_regimes)
                if name and name not in valid and name != "null":
                    more = ", or any bsBaK or wWbBaK (w >= 2)" if group == "regime" else ""
                    return (f"{key}={name}: no such {group}; valid: {', '.join(valid)}{more}"
                            f"{_meaning(group, name)}")
    return None


HYDRA_FLAGS = {"-m": 0, "--multirun": 0, "--cfg": 1, "-c": 1, "--info": 0, "--resolve": 0, "-p": 1, "--package": 1,
               "--help": 0, "--hydra-help": 0, "--version": 0, "-cn": 1, "--config-name": 1, "-cp": 1,
               "--config-path": 1, "-cd": 1, "--config-dir": 1}  # Hydra's own flags, and how many words follow each


def hydra_overrides(argv: Sequence[str]) -> List[str]:
    """The overrides of a gaexp command line, Hydra's flags dropped."""
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in HYDRA_FLAGS:
            i += 1 + HYDRA_FLAGS[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    return kept


def sweep_cases(overrides: Sequence[str], groups_only: bool = False) -> List[List[str]]:
    """Plain overrides, one list per value of each swept axis (the other axes at their first value; an interval
    at its start): every choice a multirun would compose, the first list its first cell. `groups_only`: other
    values than the first only for the axes that choose a file of a group (norm=bn,gn4; not seed=1,2,3)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    plain, swept = [], []
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        if not o.is_sweep_override():
            plain.append(text)
        else:
            values = [str(o.value().start)] if isinstance(o.value(), IntervalSweep) else list(o.sweep_string_iterator())
            swept.append((o.get_key_element(), values))
    first = [f"{key}={values[0]}" for key, values in swept]
    cases = [first] + [[*first[:axis], f"{key}={v}", *first[axis + 1:]]
                       for axis, (key, values) in enumerate(swept) if key.lstrip("+~") in GROUPS or not groups_only
                       for v in values[1:]]
    return [[*plain, *case] for case in cases]


def swept_cells(cfg: DictConfig) -> List[Tuple[List[str], DictConfig]]:
    """In a running multirun (a callback's config, which has its swept keys at their defaults): each value of
    each swept axis of its command line (`sweep_cases`), composed by Hydra's config loader as its job will be,
    with the overrides that name it. Empty outside a multirun or with nothing swept; a case that does not
    compose is left to the sweeper, which says why."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    multirun = OmegaConf.select(cfg, "hydra.mode", default=None) == RunMode.MULTIRUN
    if not multirun or not GlobalHydra.instance().is_initialized():
        return []
    overrides = [str(o) for o in OmegaConf.select(cfg, "hydra.overrides.task", default=None) or []]
    try:
        swept = sum(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(overrides))
        cases = sweep_cases(overrides) if swept else []
    except Exception:  # noqa: BLE001 - an override only the sweeper understands: it checks its own
        return []
    loader = GlobalHydra.instance().config_loader()
    cells = []
    for i, case in enumerate(cases):
        name = [o for o in case[len(case) - swept:] if i == 0 or o not in cases[0]]
        try:
            cells.append((name, loader.load_sweep_config(master_config=cfg, sweep_overrides=list(case))))
        except Exception:  # noqa: BLE001 - see above
            continue
    return cells


def compose_config(overrides: Sequence[str], hydra: bool = True) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def composition_problem(overrides: Sequence[str]) -> Optional[str]:
    """One line for what Hydra would refuse in many when it composes the first cell: a key no node has
    (`train.lrr`, `norm.groups` of norm=bn) with the keys there are, a value of the wrong type. None: it
    composes."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    try:
        case = sweep_cases(overrides)[0]
    except OverrideParseException as e:
        return str(e).splitlines()[0]
    try:
        compose_config(case)
        return None
    except ConfigCompositionException as e:
        cause = e.__cause__
        reason = str(cause).splitlines()[0] if cause is not None else ""
        found = re.match(r"Could not override '([^']+)'", str(e))
        if found and "is not in struct" in reason:  # a dict's new key: Hydra's + is the way
            return f"{found.group(1)}: a new key of a dict; add it with +{found.group(1)}=..."
        full_key = re.search(r"full_key: (\S+)", str(cause) if cause is not None else "")
        if not found or "not in '" not in reason or not full_key:  # a value of the wrong type, ...
            return str(e).splitlines()[0].rstrip(".") + (f": {reason}" if reason else "")
        key = full_key.group(1)  # the first key that is not there (hydra.sweeper.grid of hydra.sweeper.grid.norm)
        parent, _, name = key.rpartition(".")
        rest = [o for o in case if o.partition("=")[0].lstrip("+~") != found.group(1)]
        try:
            node = OmegaConf.select(compose_config(rest), parent) if parent else None
        except Exception:  # noqa: BLE001 - the listing is a courtesy; the key's problem is said either way
            node = None
        valid = [k for k in node if k != "_target_"] if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(name, valid, n=1)
        where = f"norm={rest_value(rest, 'norm', 'bn')}" if parent == "norm" else parent
        return (f"{found.group(1)}: no key {name!r} in {where}" + (f"; valid: {', '.join(valid)}" if valid else "")
                + (f" (did you mean {parent}.{close[0]}?)" if close else ""))


def rest_value(overrides: Sequence[str], key: str, default: str) -> str:
    return next((o.partition("=")[2] for o in overrides if o.partition("=")[0] == key), default)


FAILED_MARKER = "FAILED.txt"  # written into a job's folder when its cell fails inside a multirun (gaexp/app.py)


def job_config(cfg: DictConfig) -> DictConfig:
    """The config a job sees: a callback's config without its `hydra` node (as Hydra's run_job does)."""
    if "hydra" not in cfg:
        return cfg
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job
