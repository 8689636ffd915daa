"""The documents are tested: every gaexp command in README.md and docs/*.md works as written.

Commands are collected from fenced `bash` blocks (continuation lines joined, comments dropped), from `$ `
lines of transcript blocks, and from inline code that starts with a gaexp command, so a command added to
the docs is picked up without editing this file. A Hydra command composes with exactly the overrides
shown (every key and choice exists, no `+` missing, every value of a swept axis) and types (ranges
checked); the other commands parse their arguments with their own parser; a `make` target and its
variables exist. A command that cannot run on a development machine says so in its own comment,
`(needs: slurm)`, `(needs: gpu)`, `(needs: server)`, `(needs: internet)` or `(needs: nodes)` (several machines),
and still composes. A `torchrun ... -m gaexp ...` line is its gaexp command.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from mlflow.tracking import MlflowClient

from gaexp import analysis, compare, progress, tuning
from gaexp.check import cli as check_cli
from gaexp.tools import bench, drift, eta_replay, gpucheck, hf_zoo, server, storebench, storegen, ui, zoo
from gaexp.data import __main__ as data_command
from gaexp.config import job_config, composition_problem, compose_config, hydra_overrides, sweep_cases, typed, unknown_choice

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PARSERS = {"gaexp-report": analysis.main, "gaexp-status": progress.main, "gaexp-tuned": tuning.main,
           "gaexp.data": data_command.main, "gaexp.tools.bench": bench.main, "gaexp.tools.zoo": zoo.main, "gaexp.compare": compare.main,
           "gaexp.tools.ui": ui.main, "gaexp.tools.eta_replay": eta_replay.main, "gaexp.tools.storegen": storegen.main,
           "gaexp.tools.storebench": storebench.main, "gaexp.tools.server": server.main, "gaexp.tools.gpucheck": gpucheck.main,
           "gaexp.tools.drift": drift.main, "gaexp.tools.hf_zoo": hf_zoo.main}
NEEDS = re.compile(r"\(needs: (slurm|gpu|server|internet|nodes)\b")  # (needs: internet, once: ...) too


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # as written
    argv: tuple[str, ...]  # the words, comment dropped
    comment: str
    refused: str = ""  # a transcript's `error: ...` line after the command: it must print exactly that

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _command(where: str, text: str) -> Command | None:
    """The command on this line if it is one of gaexp's (after any VAR=value prefix), else None."""
    try:
        argv = shlex.split(text, comments=True)
    except ValueError:
        return None
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # CI=true make test
        argv = argv[1:]
    if not argv:
        return None
    head = argv[0]
    if head == "torchrun" and "-m" in argv:  # torchrun [its options] -m gaexp OVERRIDES: the gaexp command
        argv = argv[argv.index("-m") + 1:]
        head = argv[0] if argv else ""
    if Path(head).name in ("python", "python3") and argv[1:2] == ["-m"] and argv[2:3] and argv[2].startswith("gaexp"):
        argv = [argv[2], *argv[3:]]
    elif not (head in ("gaexp", "make") or head.startswith("gaexp-")):
        return None
    return Command(where, text, tuple(argv), _comment(text))


def _comment(text: str) -> str:
    """What follows the first `#` outside quotes that starts a word, as the shell reads a comment."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[i:]
    return ""


PLACEHOLDER = re.compile(r"(^|=)[A-Z][A-Z0-9_]*$|<|\\.\\.\\.")  # NAME, +experiment=NAME, <sweep>, ...


def _runnable_inline(command: Command) -> bool:
    """Inline code in prose is a command when it has arguments and no placeholder; `gaexp-report --window-start`
    names a flag, `python -m gaexp.tools.bench --model NAME` a form: those are mentions."""
    args = command.argv[1:]
    return bool(args) and not args[-1].startswith("--") and not any(PLACEHOLDER.search(a) for a in args)


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        name = doc.relative_to(REPO)
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            lang, body = block.groups()
            first = text.count("\n", 0, block.start(2)) + 1
            lines = body.split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                i += 1
                stripped = line.strip()
                if lang in ("bash", "sh") and stripped and not stripped.startswith("#"):
                    command = _command(f"{name}:{first + start}", stripped)
                elif stripped.startswith("$ "):
                    command = _command(f"{name}:{first + start}", stripped[2:])
                    after = lines[i].strip() if i < len(lines) else ""
                    if command is not None and re.match(r"(gaexp-check: )?error: ", after):
                        command = Command(command.where, command.text, command.argv, command.comment, after)
                else:
                    command = None
                if command is not None:
                    found.append(command)
        outside = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for span in re.finditer(r"`([^`\n]+)`", outside):
            words = span.group(1).split()
            if words and (words[0] in ("gaexp",) or words[0].startswith("gaexp-")
                          or words[:3] in (["python", "-m", "gaexp"],) or words[:2] == ["python", "-m"]
                          and words[2:3] and words[2].startswith("gaexp")) and len(words) > 1:
                command = _command(f"{name}:{outside.count(chr(10), 0, span.start()) + 1}", span.group(1))
                if command is not None and _runnable_inline(command):
                    found.append(command)
    return found


COMMANDS = documented_commands()
EXPORTS = {m.group(1): shlex.split(m.group(2))[0] for doc in DOCUMENTS  # `export NAME=value` lines of the docs
           for m in re.finditer(r"^export (\w+)=(.+)$", doc.read_text(), re.M)}


def check_hydra(overrides: list[str]) -> None:
    """Every choice of a group a multirun of these overrides composes (gaexp.config.sweep_cases), typed; the
    other axes at their first value."""
    for case in sweep_cases(overrides, groups_only=True):
        composes_and_types(tuple(case))


@functools.lru_cache(maxsize=None)
def composes_and_types(case: tuple[str, ...]) -> None:
    """Once per distinct list of overrides (the documents repeat many): raises what composing or typing does."""
    cfg = compose_config(case)
    HydraConfig.instance().set_config(cfg)
    typed(job_config(cfg))


class _Parsed(Exception):
    """Raised by argparse once a command's arguments parsed: the command itself never runs."""


def check_parses(main, argv: list[str], monkeypatch) -> argparse.Namespace:
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(_Parsed) as parsed:
        main(argv)
    return parsed.value.args[0]


def make_targets() -> tuple[set[str], set[str]]:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*\?=", makefile, re.M))
    return targets, variables


def test_the_documents_hold_commands_of_every_family():
    families = {c.argv[0] for c in COMMANDS}
    assert {"gaexp", "gaexp-report", "gaexp-status", "gaexp-tuned", "gaexp-check", "gaexp.data", "make"} <= families
    assert len(COMMANDS) > 100
    for c in COMMANDS:  # what a development machine cannot run says so
        text = " ".join(c.argv)
        cannot = (("launch=slurm" in text and "--cfg" not in text) or re.search(r"https?://(?!127\.0\.0\.1)", text)
                  or re.search(r"--nnodes[ =](?!1\b)", c.text)
                  or (c.argv[0] == "gaexp" and re.search(r"data=(cifar|svhn)", text))
                  or (c.argv[0] == "gaexp.data" and re.search(r"--dataset (cifar|svhn)", text)))
        assert not cannot or NEEDS.search(c.comment), f"{c}: say what it needs in its comment: # (needs: ...)"


def refusal(argv: tuple[str, ...]) -> str:
    """The one line `gaexp` ends with on this bad input (its checks before Hydra's, then the typed config's)."""
    overrides = hydra_overrides(argv[1:])
    problem = unknown_choice(overrides) or composition_problem(overrides)
    if problem:
        return f"error: {problem}"
    try:
        check_hydra(overrides)
    except ValueError as e:
        return f"error: {e}"
    return "(accepted)"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_works_as_written(command, monkeypatch, tmp_path):
    head, args = command.argv[0], list(command.argv[1:])
    monkeypatch.chdir(tmp_path)  # nothing read from, or written into, the checkout
    if command.refused:
        printed = refusal(command.argv) if head == "gaexp" else check_cli.run(args)[1]
        assert printed == command.refused
    elif head == "gaexp":
        for name in re.findall(r"\$\{oc\.env:(\w+)\}", command.text):  # as the docs export it beside the command
            assert name in EXPORTS, f"{command}: ${{oc.env:{name}}} with no `export {name}=...` in the docs"
            monkeypatch.setenv(name, EXPORTS[name])
        check_hydra(hydra_overrides(command.argv[1:]))
    elif head in ("gaexp-check", "gaexp.check"):
        parsed = check_cli.parser().parse_intermixed_args(args)
        if "=" in parsed.target[0]:
            check_hydra([t for t in parsed.target])
    elif head == "make":
        targets, variables = make_targets()
        for word in args:
            name, sep, _ = word.partition("=")
            assert (name in variables) if sep else (name in targets), f"{word}: not a target or variable of the Makefile"
    else:
        assert head in PARSERS, f"{head}: a command the docs test does not know"
        parsed = check_parses(PARSERS[head], args, monkeypatch)
        if head == "gaexp-tuned" and parsed.overrides:
            check_hydra(parsed.overrides)


def parser_options(main, monkeypatch) -> list[str]:
    """The long options a console script's parser takes (--help aside), in its order: its `main` builds the
    parser and is stopped at parse_args."""
    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed) as stopped:
        main([])
    parser = stopped.value.args[0]
    return [next(s for s in action.option_strings if s.startswith("--")) for action in parser._actions
            if any(s.startswith("--") for s in action.option_strings) and "--help" not in action.option_strings]


def option_tables() -> list[tuple[str, str, list[str]]]:
    """(document, command, options listed) for each `| option | ...` table that follows a `bash` block of one
    console script's commands (PARSERS): the table of what that command takes."""
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for table in re.finditer(r"^\| option \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M):
            blocks = list(re.finditer(r"^```(?:bash|sh)\n(.*?)^```", text[:table.start()], re.S | re.M))
            commands = [_command("", line.strip()) for line in blocks[-1].group(1).split("\n")] if blocks else []
            heads = {c.argv[0] for c in commands if c is not None}
            if len(heads) == 1 and (head := heads.pop()) in PARSERS:
                found.append((str(doc.relative_to(REPO)), head, re.findall(r"^\| `(--[\w-]+)`", table.group(1), re.M)))
    return found


OPTION_TABLES = option_tables()


def test_the_report_has_an_options_table():
    assert ("docs/tracking.md", "gaexp-report") in {(doc, head) for doc, head, _ in OPTION_TABLES}


@pytest.mark.parametrize("doc, head, listed", OPTION_TABLES, ids=[f"{doc}:{head}" for doc, head, _ in OPTION_TABLES])
def test_an_options_table_lists_every_option_of_its_command(doc, head, listed, monkeypatch):
    """A command's options table has one row per option its parser takes, in the parser's order (`--help` aside)."""
    options = parser_options(PARSERS[head], monkeypatch)
    missing, unknown = [o for o in options if o not in listed], [o for o in listed if o not in options]
    assert not missing, f"{doc}: the {head} table lacks {missing}"
    assert not unknown, f"{doc}: the {head} table lists {unknown}, which {head} does not take"
    assert listed == options, f"{doc}: the {head} table's rows in the parser's order: {options}"


CONTENTS_ITEM = re.compile(r"^( *)(?:- |(\d+\.) )\[(.+)\]\(#(.+)\)$", re.M)  # - [Title](#anchor), 1. [Title](#anchor)


def github_anchor(title: str) -> str:
    """The anchor GitHub makes for a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def contents_list(text: str) -> list[tuple[bool, str, str]]:
    """The contents list before a page's first `## ` heading: (nested, title, anchor) per entry; a numbered
    entry `1. [Title]` stands for the heading `1. Title`."""
    return [(bool(indent), f"{number} {title}" if number else title, target)
            for indent, number, title, target in CONTENTS_ITEM.findall(text.split("\n## ", 1)[0])]


PAGES_WITH_CONTENTS = [doc for doc in DOCUMENTS if contents_list(doc.read_text())]


def test_the_guide_pages_have_a_contents_list():
    names = {doc.name for doc in PAGES_WITH_CONTENTS}
    assert {"configuration.md", "data.md", "check.md", "tracking.md", "tuning.md"} <= names


@pytest.mark.parametrize("doc", PAGES_WITH_CONTENTS, ids=lambda doc: doc.name)
def test_a_contents_list_lists_every_section(doc):
    """A page's contents: every ## and ### heading outside code, in order, with the anchor GitHub makes."""
    outside = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    headings = re.findall(r"^(##|###) (.+)$", outside, re.M)
    expected = [(level == "###", title, github_anchor(title)) for level, title in headings]
    assert contents_list(doc.read_text()) == expected


# Our own commits and issues, which a reader cannot look up: a hash of 7 to 12 hex digits with a letter and a digit,
# standing alone (not a checksum's 32, not inside a package's version such as 0.0~git20200523.55506a9-1), or "issue N".
# Another project's issue by its own name (Megatron-LM#149) is theirs to look up.
OWN_REFERENCE = re.compile(r"(?<![\w.~/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w.~/-])|\bissues? #?\d+",
                           re.I)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda doc: doc.name)
def test_a_document_names_no_commit_or_issue_of_ours(doc):
    """Dates, and the command that reproduces a figure, are what a reader can use; a commit hash or an issue number
    of this project's is not."""
    found = [(number, m.group(0)) for number, line in enumerate(doc.read_text().splitlines(), 1)
             for m in OWN_REFERENCE.finditer(line)]
    assert not found, f"{doc.name}: (line, reference) {found}: say it by date, or by the command that reproduces it"


def test_the_readme_is_a_front_door():
    """README.md under 100 lines: the command, the table, one line per finding with its link into docs/."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < 100, f"README.md has {lines} lines: move the detail into docs/ and link to it"


# --- a newcomer's walk: one documented command of each family, as written, at a tiny budget ----------------

BUDGET = ["train.num_iterations=4", "train.eval_period=4", "device=cpu", "compile=off"]  # one evaluation


def documented(document: str, start: str) -> Command:
    """The first command of `document` whose words start with `start` (the test follows the docs: change the
    command there and the walk runs the new one)."""
    found = [c for c in COMMANDS if c.where.split(":")[0] == document and " ".join(c.argv).startswith(start)]
    assert found, f"{document} no longer shows a command starting {start!r}: give the walk another"
    return found[0]


def shell(command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def line_of(command: Command) -> int:
    return int(command.where.split(":")[1])


@pytest.mark.slow
def test_a_newcomers_walk_begins_with_the_readmes_setup(tmp_path, data_root):
    """The README's quick start before the study, in its order, as written: `make help` (what `make` alone
    prints: it installs nothing) lists every target; `make setup` as a dry run into a fresh folder (the install
    it would run, announced with its size and time; nothing installed); `make data`'s command, run; the
    activation line, which alone puts the console scripts on PATH; then the first short run, with the
    activated venv's `gaexp`, cut to the 4-step budget, in an empty folder whose outputs/data holds MNIST."""
    readme = (REPO / "README.md").read_text()
    help_, setup, data = (documented("README.md", start) for start in ("make help", "make setup", "make data"))
    activate = re.search(r"^source (\S+)/bin/activate +#", readme, re.M)
    assert activate, "README.md no longer says to activate the venv: `gaexp` is then not on PATH"
    venv = REPO / activate.group(1)
    first_run = documented("README.md", "gaexp ")
    assert (line_of(setup) < line_of(data) < readme.count("\n", 0, activate.start()) + 1 < line_of(first_run)
            < line_of(documented("README.md", "make sweep"))), "the quick start's order: setup, data, activate, a run, the sweep"

    listed = shell(shlex.join(help_.argv), REPO)
    for target in make_targets()[0]:
        assert re.search(rf"^  {re.escape(target)} +\S", listed, re.M), f"make help does not list {target} (a `##` comment)"
    default = re.search(r"^\.DEFAULT_GOAL := (\S+)$", shell("make -p -n help", REPO), re.M)  # read, nothing run
    assert default and default.group(1) == "help", "`make` alone must list the targets, not start a 6 GB install"
    assert shell("make", REPO) == listed

    fresh = tmp_path / "fresh-venv"
    dry = shell(shlex.join([setup.argv[0], "-n", *setup.argv[1:], f"VENV={fresh}"]), REPO)
    assert not fresh.exists()
    assert re.search(r'^echo ".*\d GB .*minutes', dry, re.M), f"the install does not say its size and time:\n{dry}"
    for step in (f"-m venv {fresh}", f"{fresh}/bin/python -m pip install", " torch==", " -e ."):
        assert step in dry, f"make setup would not run {step!r}:\n{dry}"

    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "data").symlink_to(data_root)
    dry = shell(shlex.join([data.argv[0], "-n", *data.argv[1:], f"VENV={venv}"]), REPO)
    fetch = [line for line in dry.splitlines() if " -m gaexp.data " in line]
    assert len(fetch) == 1, dry
    assert shell(fetch[0], tmp_path).startswith("mnist: 60,000 training + 10,000 test images")

    bin_ = venv / "bin"
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if Path(p) not in (bin_, Path(sys.executable).parent))
    bare = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    unactivated = subprocess.run(["bash", "-c", "gaexp --help"], cwd=tmp_path, env=bare, capture_output=True, text=True)
    assert "not found" in unactivated.stderr  # what a newcomer met before the README said to activate
    activated = f"source {shlex.quote(str(bin_))}/activate"
    scripts = ("gaexp", "gaexp-report", "gaexp-check", "gaexp-status")
    found = shell(f"{activated} && command -v {' '.join(scripts)}", tmp_path, bare)
    assert found.split() == [str(bin_ / name) for name in scripts]

    budget = {word.split("=")[0] for word in BUDGET}
    words = [w for w in first_run.argv if w.split("=")[0] not in budget] + BUDGET
    printed = shell(f"{activated} && {shlex.join(words)}", tmp_path, bare)
    assert re.search(r"final valid_acc 0\.\d{4} \(run \w+\)", printed), printed


@pytest.mark.slow
def test_a_newcomers_walk_runs_a_documented_command_of_each_family(tmp_path, data_root, monkeypatch, capsys):
    """In an empty folder whose outputs/data holds MNIST (where `make data` puts it): the data, a check, an
    Optuna search (a study file), gaexp-tuned, a report, the status and the UI, each as the docs write it,
    the sweeps cut to one cell or study and a 4-step budget (the objective's window from step 0): the only
    words added."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "data").symlink_to(data_root)
    monkeypatch.chdir(tmp_path)

    def run(argv: list[str]) -> str:
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    data = documented("docs/data.md", "gaexp.data --root outputs/data")
    data_command.main(list(data.argv[1:]))
    assert capsys.readouterr().out.startswith("mnist: 60,000 training + 10,000 test images of 1x28x28, 10 classes")

    check = documented("docs/check.md", "gaexp-check model=simple norm=gn4 --data mnist")
    with pytest.raises(SystemExit) as done:
        check_cli.main(list(check.argv[1:]))
    assert done.value.code == 0 and "SAFE" in capsys.readouterr().out

    search = documented("README.md", "gaexp -m +experiment=tune_lr")
    printed = run(["gaexp", *search.argv[1:], "hydra.sweeper.grid.norm=gn4", "hydra.sweeper.grid.regime=bs16a1",
                   "hydra.sweeper.n_trials=2", "data.holdout=500", "analysis.window_start=0", *BUDGET])
    assert re.search(r"\| 2/2 trials: \d complete, \d pruned, 0 failed, 0 running, 0 waiting; best 0\.\d{4}", printed)

    tuned = documented("docs/tuning.md", "gaexp-tuned --run")
    run(["gaexp.tuning", *tuned.argv[1:]])
    report = documented("docs/tuning.md", "gaexp-report --experiment gaexp-tune_lr-test")
    analysis.main(list(report.argv[1:]))
    table = capsys.readouterr().out
    assert "| gn4 | bs16a1 |" in table  # the one cell tuned, at its best lr

    status = documented("docs/tracking.md", "gaexp-status")
    progress.main([*status.argv[1:], "--experiment", "gaexp-tune_lr-test"])
    assert re.match(r"sweep \S+ \(FINISHED\)\n  3/3 cells: 3 finished, 0 running;", capsys.readouterr().out)

    execs = []
    monkeypatch.setattr(ui.os, "execve", lambda path, argv, env: execs.append(argv))
    make_ui = documented("docs/tracking.md", "make ui")
    assert make_ui.argv == ("make", "ui")  # the Makefile's ui target: python -m gaexp.tools.ui --store $(STORE) ...
    ui.main([])
    links = capsys.readouterr().out
    for experiment in ("gaexp-tune_lr", "gaexp-tune_lr-test"):  # the search's, the reruns'
        assert re.search(rf"^{experiment}: \d+ runs  http://127\.0\.0\.1:5000/#/experiments/\d+\?workflowType=machine_learning$",
                         links, re.M), links
    assert execs and execs[0][1:3] == ["ui", "--backend-store-uri"]


def test_the_example_that_reloads_a_model_runs_on_a_trained_cell(tmp_path, gaexp_command, data_root):
    """docs/tracking.md's Python example, run as written from a folder whose outputs/ holds a trained cell: the
    model reloads and scores its run's final accuracy, then again with each image's own statistics."""
    text = (REPO / "docs" / "tracking.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "load_model" in block)
    out = tmp_path / "outputs"
    out.mkdir()
    (out / "data").symlink_to(data_root)
    done = gaexp_command(out, "norm=bn", "regime=bs1a16", "seed=1", "data.holdout=0",  # the example's test set
                         "train.eval_period=4")  # evaluated once, at the step the example reloads
    assert done.returncode == 0, done.stderr[-2000:]
    ran = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = dict(line.split(": ") for line in ran.stdout.splitlines())
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run, = [r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id]) if "norm" in r.data.tags]
    assert float(lines["running averages"]) == run.data.metrics["final_valid_acc"]
    assert 0.0 <= float(lines["micro-batch statistics"]) <= 1.0


def test_the_layout_names_every_module():
    """docs/development.md's layout follows the house: every module of gaexp/ is named there, in its wing."""
    text = (REPO / "docs" / "development.md").read_text()
    layout = text[text.index("## Layout"):text.index("## The data flow")]
    modules = sorted(p.relative_to(REPO) for p in (REPO / "gaexp").rglob("*.py") if p.stem != "__init__")
    missing = [str(m) for m in modules if not re.search(rf"\b{re.escape(m.stem)}\b", layout)
               or (len(m.parts) > 2 and f"gaexp/{m.parts[1]}/" not in layout)]
    assert not missing, f"docs/development.md's layout does not name {missing}"
