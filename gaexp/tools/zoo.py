"""`python -m gaexp.tools.zoo`: gaexp-check on every torchvision classification model, against the truth.

A benchmark, not a test (the whole zoo takes tens of minutes on 2 cores; tests/test_zoo.py runs a few models).
Each model is built by its torchvision builder with its default settings (no weights), at the smallest input of
a ladder of square sizes it accepts in training and in evaluation mode, and checked by the command itself
(`gaexp-check torchvision.models:NAME --input-shape 3,S,S --seed SEED --json`) at each seed. The truth is worked
out without the check: a model is unsafe to accumulate exactly when it has a batch-statistics layer (a
BatchNorm of any dimension) in training mode, and the modules to name are exactly those layers. Each model runs
in a process of its own, so one that runs out of memory or time is a row of the table, not the end of the run.

    python -m gaexp.tools.zoo                                    # every model, seeds 0 1 2: the table on stdout
    python -m gaexp.tools.zoo --models convnext_tiny vit_b_16 --seeds 0 --output zoo.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299)  # the ladder of square inputs, smallest first
SEEDS = (0, 1, 2)


def classification_models() -> list[str]:
    import torchvision.models

    return torchvision.models.list_models(module=torchvision.models)


def truth(model: Any) -> list[str]:
    """The modules an exact check must name: the batch-statistics layers in training mode."""
    from torch import nn

    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]


def smallest_input(model: Any, sizes: Sequence[int]) -> tuple[int | None, str]:
    """The smallest size S of the ladder at which a batch of 2 of shape 3xSxS passes the forward in training and
    in evaluation mode (the model's buffers given back); (None, the last refusal) when none does."""
    import torch

    state = {k: v.detach().clone() for k, v in model.named_buffers()}  # the forward changes buffers only
    reason = ""
    try:
        for size in sizes:
            try:
                with torch.no_grad():
                    x = torch.rand(2, 3, size, size)
                    model.train()
                    model(x)
                    model.eval()
                    model(x)
                return size, ""
            except Exception as e:  # noqa: BLE001 - a refusal of this size: try the next
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(state[k])
        model.train()
    return None, reason


def check_one(name: str, seeds: Sequence[int], sizes: Sequence[int]) -> dict[str, Any]:
    """One model: its input, its truth, and gaexp-check's answer at each seed (in this process)."""
    import torch
    import torchvision.models

    from gaexp.check.cli import run

    torch.manual_seed(0)
    model = torchvision.models.get_model(name)
    row: dict[str, Any] = {"model": name, "params": sum(p.numel() for p in model.parameters()),
                           "truth": truth(model), "seeds": []}
    size, reason = smallest_input(model, sizes)
    row["size"] = size
    if size is None:
        row["error"] = f"no input of {', '.join(map(str, sizes))} accepted ({reason})"
        return row
    del model
    for seed in seeds:
        tic = time.perf_counter()
        status, text = run([f"torchvision.models:{name}", "--input-shape", f"3,{size},{size}", "--seed", str(seed),
                            "--json"])
        wall = time.perf_counter() - tic
        if text.startswith("{"):
            report = json.loads(text)
            row["seeds"].append({"seed": seed, "status": status, "verdict": report["verdict"],
                                 "named": [c["module"] for c in report.get("modules", [])],
                                 "random": [(m["type"], m["found"]) for m in report.get("stochastic", [])],
                                 "untested": report.get("untested", []), "nonfinite": report.get("nonfinite"),
                                 "gradient_rel": report.get("gradient_rel"), "seconds": report.get("seconds"),
                                 "wall": wall})
        else:
            row["seeds"].append({"seed": seed, "status": status, "verdict": "error", "error": text, "wall": wall})
    return row


@dataclass
class Judged:
    row: dict[str, Any]
    outcome: str  # "right", "false alarm", "miss", "wrong modules", "error", "not checked"
    notes: list[str] = field(default_factory=list)


def judge(row: dict[str, Any]) -> Judged:
    """The check's answers against the truth, at every seed."""
    if "error" in row:
        return Judged(row, "not checked", [row["error"]])
    want = "unsafe" if row["truth"] else "safe"
    outcomes = []
    for s in row["seeds"]:
        if s["verdict"] in ("error", "non-finite"):
            outcomes.append(("error", f"seed {s['seed']}: exit {s['status']}: {s.get('error') or s.get('nonfinite')}"))
        elif s["verdict"] != want:
            outcomes.append(("false alarm" if want == "safe" else "miss", f"seed {s['seed']}: {s['verdict']}"))
        elif s["named"] != row["truth"]:
            extra = sorted(set(s["named"]) - set(row["truth"]))
            missing = sorted(set(row["truth"]) - set(s["named"]))
            outcomes.append(("wrong modules", f"seed {s['seed']}: named also {extra[:3]}, not {missing[:3]}"))
        else:
            outcomes.append(("right", ""))
    wrong = [o for o in outcomes if o[0] != "right"]
    return Judged(row, wrong[0][0] if wrong else "right", [note for _, note in wrong])


def _random(seeds: list[dict[str, Any]]) -> str:
    """The first seed's random modules, counted by type."""
    types = [t for t, _ in seeds[0].get("random", [])] if seeds else []
    return ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types)) or "none"


def table(judged: list[Judged]) -> str:
    """The markdown table: a row per model, then the counts."""
    lines = ["| model | input | params | BatchNorm layers (truth) | verdict at each seed | named = truth | random "
             "modules (flag off) | untested | check s (max) | outcome |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for j in judged:
        r, seeds = j.row, j.row.get("seeds", [])
        verdicts = ", ".join(dict.fromkeys(s["verdict"] for s in seeds)) or "-"
        named = all(s.get("named") == r["truth"] for s in seeds) if seeds else False
        seconds = [s["seconds"] for s in seeds if s.get("seconds") is not None]
        untested = max((len(s.get("untested", [])) for s in seeds), default=0)
        size = f"3x{r['size']}x{r['size']}" if r.get("size") else "-"
        outcome = j.outcome + (f" ({'; '.join(j.notes)})" if j.notes else "")
        checked = [("yes" if named else "no"), _random(seeds), str(untested), f"{max(seconds):.1f}"] if seconds \
            else ["-"] * 4
        lines.append(" | ".join(["", r["model"], size, f"{r['params'] / 1e6:.1f}M", str(len(r["truth"])), verdicts,
                                 *checked, outcome, ""]).strip())
    counts: dict[str, int] = {}
    for j in judged:
        counts[j.outcome] = counts.get(j.outcome, 0) + 1
    lines += ["", f"{len(judged)} models: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    return "\n".join(lines)


def run_model(name: str, seeds: Sequence[int], sizes: Sequence[int], timeout: float) -> dict[str, Any]:
    """check_one in a process of its own (out of memory or time is a row, not the end of the zoo)."""
    argv = [sys.executable, "-m", "gaexp.tools.zoo", "--one", name, "--seeds", *map(str, seeds),
            "--sizes", ",".join(map(str, sizes))]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": name, "params": 0, "truth": [], "error": f"took over {timeout:.0f} s"}
    last = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode != 0 or not last[0].startswith("{"):
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"model": name, "params": 0, "truth": [], "error": f"exit {done.returncode}: {why}"[:200]}
    return json.loads(last[0])


def _sizes(text: str) -> tuple[int, ...]:
    from gaexp.arguments import positive_ints

    return positive_ints(text, "square sizes, smallest first, e.g. 32,64,224")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaexp.tools.zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, help="torchvision model names (default: every "
                   "classification model of torchvision.models.list_models)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="default: %(default)s")
    p.add_argument("--sizes", type=_sizes, default=SIZES, help="the ladder of square input sizes (default: "
                   f"{','.join(map(str, SIZES))})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per model (default: %(default)s)")
    p.add_argument("--output", default=None, help="also write the table (and the raw rows as OUTPUT.jsonl) here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one model, JSON out
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(check_one(args.one, args.seeds, args.sizes)))
        return
    known = classification_models()
    models = args.models or known
    unknown = [m for m in models if m not in known]
    if unknown:
        p.error(f"--models {' '.join(unknown)}: not torchvision classification models; valid: {', '.join(known)}")
    judged = []
    raw = open(f"{args.output}.jsonl", "w") if args.output else None
    for i, name in enumerate(models, 1):
        tic = time.perf_counter()
        row = run_model(name, args.seeds, args.sizes, args.timeout)
        j = judge(row)
        judged.append(j)
        print(f"[{i}/{len(models)}] {name}: {j.outcome} ({time.perf_counter() - tic:.0f} s)", file=sys.stderr,
              flush=True)
        if raw:
            raw.write(json.dumps(row) + "\n")
            raw.flush()
    text = table(judged)
    print(text)
    if args.output:
        raw.close()
        with open(args.output, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if all(j.outcome in ("right", "not checked") for j in judged) else 1)


if __name__ == "__main__":
    main()
