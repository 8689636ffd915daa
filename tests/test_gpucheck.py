"""The GPU check's CPU form (`--device cpu --tiny`): every step runs and reports, so the command a person
with a GPU runs cannot rot. On the CPU the two devices are the same one: every comparison is exact."""

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_gpu_check_runs_every_step_on_the_cpu_and_prints_one_summary(tmp_path, data_root):
    done = subprocess.run([sys.executable, "-m", "gaexp.tools.gpucheck", "--device", "cpu", "--tiny", "--data-root",
                           str(data_root), "--work", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = done.stdout.splitlines()
    speeds = [line for line in lines if re.match(r"  (bn|gn4) +bs(4a4|16a1) +\d+ +\d+ +\d+ +[\d.]+x +[\d.]+x$", line)]
    assert len(speeds) == 4 and all(int(word) > 0 for line in speeds for word in line.split()[2:5])
    assert "determinism: norm=bn regime=bs4a4, deterministic=true, run twice: identical, bit for bit" in lines
    verdicts = [line for line in lines if re.match(r"  gn4 +bs4a4 +cpu", line)]
    assert len(verdicts) == 1 and verdicts[0].endswith("diff +0.00  equivalent (bit for bit)")
    assert re.search(r"^cells sharing the device, the small grid's wall time: 1 at once \d+ s \(1\.00x\), "
                     r"2 at once \d+ s \([\d.]+x\)$", done.stdout, re.M)
    assert "peak CUDA memory per regime: none recorded (device=cpu)" in lines
    assert "gaexp-check model=simple norm=gn4 on cpu: exit status 0, verdict safe" in lines
    assert re.match(r"done in \d+ s: every step passed$", lines[-1])
