"""A search's space from its overrides: each key's Optuna distribution (choice, interval, range) or its fixed
value, the grid's axes beside them, and the sampler over that space (the grid sampler's points filled in).
Private, so Hydra's plugin scan does not import Optuna in every application."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.errors import HydraException
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from hydra_plugins.gaexp_optuna_sweeper.config import SweeperError
from hydra_plugins.gaexp_optuna_sweeper.trials import make

FORMS = ("choice(a, b, ...) or a,b,..., interval(a, b), int(interval(a, b)), tag(log, interval(a, b)), "
         "range(a, b, step) or a fixed value")


def parse(key: str, value: str) -> Override:
    try:
        (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
    except HydraException as e:
        why = " ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip() and not line.startswith("See "))
        raise SweeperError(f"{key}={value!r} is not a value or a sweep ({why}); valid: {FORMS}") from None
    return override


def distribution(override: Override) -> BaseDistribution | str:
    """The Optuna distribution of a searched override, or the string of a fixed one."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    name, value = override.get_key_element(), override.value()
    where = f"{name}={override.input_line.split('=', 1)[1] if override.input_line else value}"
    if isinstance(value, ChoiceSweep):
        choices = list(override.sweep_iterator())
        if not choices:
            raise SweeperError(f"{where}: an empty choice; valid: choice(a, b, ...) with one value or more")
        return CategoricalDistribution(choices)
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            raise SweeperError(f"{where}: an empty range; valid: range(a, b, step) with a < b for step > 0")
        step = value.step or 1
        if any(isinstance(v, float) for v in (value.start, value.stop, step)):
            return FloatDistribution(float(values[0]), float(values[-1]), step=float(step))
        return IntDistribution(int(values[0]), int(values[-1]), step=int(step))
    if isinstance(value, IntervalSweep):
        low, high, tags = value.start, value.end, set(value.tags)
        if tags - {"log"}:
            raise SweeperError(f"{where}: unknown tag(s) {sorted(tags - {'log'})}; valid: tag(log, interval(a, b))")
        if not low < high:
            raise SweeperError(f"{where}: an empty or inverted interval; valid: interval(a, b) with a < b")
        if "log" in tags and low <= 0:
            raise SweeperError(f"{where}: a log scale needs bounds > 0; valid: tag(log, interval(a, b)) with 0 < a < b")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log="log" in tags)
        return FloatDistribution(float(low), float(high), log="log" in tags)
    raise SweeperError(f"{where}: not supported; valid: {FORMS}")


def split_arguments(params: Dict[str, str], grid: Dict[str, str], arguments: Sequence[str]
                    ) -> Tuple[Dict[str, BaseDistribution], Dict[str, str], List[List[str]]]:
    """(search space, fixed values, grid axes as lists of key=value): the config's params and grid,
    then the command line, which wins. A key of `grid` is a grid axis wherever it is given."""
    space: Dict[str, BaseDistribution] = {}
    fixed: Dict[str, str] = {}
    axes: Dict[str, List[str]] = {}
    parsed = [parse(k, v) for k, v in params.items()]
    parsed += [parse(k, v) for k, v in grid.items()]
    for line in arguments:
        key, _, value = line.partition("=")
        parsed.append(parse(key, value))
    grid_keys = set(grid)
    for override in parsed:
        key = override.get_key_element()
        space.pop(key, None), fixed.pop(key, None)
        if key in grid_keys:  # a grid axis, in study names; a comma list elsewhere is a choice, as in the official plugin
            values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
            axes[key] = [f"{key}={v}" for v in values]  # keeps its first place: study names read in grid order
        else:
            axes.pop(key, None)
            found = distribution(override)
            (space if isinstance(found, BaseDistribution) else fixed)[key] = found
    return space, fixed, list(axes.values())


def grid_points(space: Dict[str, BaseDistribution]) -> Dict[str, list]:
    """Every value of each searched key, for the grid sampler: choices, or a range's steps."""
    values = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif dist.step is not None:
            values[key] = [dist.low + i * dist.step for i in range(int(round((dist.high - dist.low) / dist.step)) + 1)]
        else:
            raise SweeperError(f"{key}: the grid sampler needs discrete values; valid: choice(...) or range(...)")
    return values


def make_sampler(node: Any, space: Dict[str, BaseDistribution]) -> optuna.samplers.BaseSampler:
    """The sampler of a study; the grid sampler's points, if not given, are the searched keys' values."""
    filled = {}
    if str(OmegaConf.select(node, "_target_")).endswith("GridSampler") and node.get("search_space") is None:
        filled["search_space"] = grid_points(space)
    return make(node, "hydra.sweeper.sampler", optuna.samplers.BaseSampler, **filled)
