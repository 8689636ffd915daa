"""Every tag and metric name is spelled in its registry alone (gaexp/tags.py, gaexp/metrics.py): the package and its
plugins read and write them through the registries' names, never as literals."""

import ast
import re
from pathlib import Path

import pytest

from gaexp import metrics, tags
from gaexp.config import Config, schema_leaves

REPO = Path(__file__).resolve().parents[1]
REGISTRIES = {REPO / "gaexp" / "tags.py", REPO / "gaexp" / "metrics.py",
              REPO / "hydra_plugins" / "gaexp_optuna_sweeper" / "config.py"}  # Optuna's attributes, one named as a tag
SOURCES = sorted(p for root in ("gaexp", "hydra_plugins") for p in (REPO / root).rglob("*.py") if p not in REGISTRIES)
TAG_NAMES = {v for k, v in vars(tags).items() if k.isupper() and isinstance(v, str)}
METRIC_NAMES = {m.name for m in (*metrics.METRICS, *metrics.SEARCH_METRICS)}
CONFIG_KEYS = {part for name, _, _ in schema_leaves(Config) for part in (name, *name.split("."))}  # params: the config's
COMPOUND = {n for n in TAG_NAMES | METRIC_NAMES if re.search(r"[._]", n)} - CONFIG_KEYS  # spelled by no prose, no config
FILTER = re.compile(r"\b(?:tags|metrics)\.(`[^`]+`|[A-Za-z_][\w.]*)\s*(?:=|!=|<|>|LIKE|ILIKE|IN)")  # a search filter's clause
READERS = {"tags", "metrics"}  # run.data.tags[...], tags.get(...), metrics[...]
WRITERS = {"set_tag": 1, "log_metric": 1}  # the argument that names a tag or metric


def _names_a_store_field(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in READERS) or (isinstance(node, ast.Attribute)
                                                                  and node.attr in READERS)


def _text(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def literal_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, the literal) of each tag or metric written by hand: a registered compound name anywhere, a filter's
    `tags.name`, a literal key read from a run's tags or metrics or written by set_tag/log_metric, a literal key of
    a dict given as `tags=`."""
    found = []
    exported = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets) for c in ast.walk(n.value)}
    for node in ast.walk(tree):
        if id(node) in exported:  # a package's __all__ names its functions (protocol_key), no tag
            continue
        text = _text(node) if isinstance(node, ast.Constant) else None
        if text is not None:
            if text in COMPOUND:
                found.append((node.lineno, text))
            found += [(node.lineno, m.group(1).strip("`")) for m in FILTER.finditer(text)]
        elif isinstance(node, ast.Subscript) and _names_a_store_field(node.value) and _text(node.slice) is not None:
            found.append((node.lineno, _text(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            position = WRITERS.get(node.func.attr)
            if node.func.attr == "get" and _names_a_store_field(node.func.value) and node.args:
                position = 0
            if position is not None and len(node.args) > position and _text(node.args[position]) is not None:
                found.append((node.lineno, _text(node.args[position])))
            for keyword in node.keywords:
                if keyword.arg == "tags" and isinstance(keyword.value, ast.Dict):
                    found += [(key.lineno, _text(key)) for key in keyword.value.keys
                              if key is not None and _text(key) is not None]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_tag_or_metric_is_spelled_outside_its_registry(path):
    found = literal_names(ast.parse(path.read_text()))
    assert not found, f"{path.relative_to(REPO)} spells these by hand; use gaexp.tags or gaexp.metrics: {found}"


@pytest.mark.parametrize("source, literal", [
    ("run.data.tags['norm']", "norm"),                       # a reader of a one-word tag
    ("tags.get('sweep_id', '')", "sweep_id"),
    ("run.data.metrics['valid_acc']", "valid_acc"),
    ("client.set_tag(run_id, 'diverged_step', '3')", "diverged_step"),
    ("client.create_run(e, tags={'gaexp.role': 'sweep'})", "gaexp.role"),
    ("f\"tags.`gaexp.role` = '{x}'\"", "gaexp.role"),          # a search filter
    ("\"tags.norm != ''\"", "norm"),
    ("columns = ['train_loss']", "train_loss"),               # a metric's name as a column
])
def test_the_scan_finds_each_way_of_spelling_a_name(source, literal):
    assert literal in [text for _, text in literal_names(ast.parse(source))]


def test_the_scan_lets_registry_names_and_prose_pass():
    source = ("run.data.tags[tags.NORM]; client.set_tag(r, tags.HOST, h); tags.filter_equals(tags.ROLE, tags.PLAN_ROLE)\n"
              "x = {'norm': 1}; print('the norm of a run, gaexp/tags.py'); columns = [metrics.VALID_ACC.name]\n"
              "f'tags.`{tags.ROLE}` = 1'")
    assert literal_names(ast.parse(source)) == []


def test_every_name_is_declared_once():
    names = [v for k, v in vars(tags).items() if k.isupper() and isinstance(v, str)] + [m.name for m in (*metrics.METRICS, *metrics.SEARCH_METRICS)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_a_cell_and_a_plan_are_tagged_as_strings_a_search_can_match():
    cell = tags.cell_tags(dataset="mnist", model="simple", norm="bn", regime="bs4a4", seed=1, batch_size=4, num_accum=4,
                          replicas=1, accumulate="batched", precision="fp32", setting="auto", sweep_id="s", protocol_key="k",
                          device="cpu", threads=2, compiled="off", **{tags.SINGLE_RUN: "true"})
    assert cell[tags.SEED] == "1" and cell[tags.SWEEPS] == "s" and cell[tags.SINGLE_RUN] == "true"
    assert all(isinstance(v, str) for v in cell.values())
    plan = tags.plan_tags(sweep_id="s", cells=12, expected_s=3.14159, cells_at_once=None, graphs=2.0, costs=None,
                          order="given")
    assert plan == {tags.ROLE: tags.PLAN_ROLE, tags.SWEEP_ID: "s", tags.CELLS: "12", tags.EXPECTED_S: "3.142",
                    tags.CELLS_AT_ONCE: "", tags.GRAPHS: "2.0", tags.COSTS: "", tags.ORDER: "given"}
    assert tags.filter_equals(tags.ROLE, tags.PLAN_ROLE) == "tags.`gaexp.role` = 'sweep'"
