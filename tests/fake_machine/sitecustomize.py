"""What every Python process the tests start gets (tests/conftest.py puts this folder first on PYTHONPATH): new
SQLite stores from the suite's template (store_template.py, GAEXP_TEST_STORE_TEMPLATE); and a machine of another
size, for the whole suite: `GAEXP_TEST_CPUS=64 make test` (and/or
`GAEXP_TEST_CPU_QUOTA=2`, a container's cgroup quota). tests/conftest.py applies it to the test process
and puts this folder first on PYTHONPATH, so every Python process the tests start (gaexp commands, their
jobs) imports it as `sitecustomize` and sees the same machine through `gaexp.machine.usable_cores`."""

import os
import tempfile
from pathlib import Path


def apply() -> None:
    cpus, quota = os.environ.get("GAEXP_TEST_CPUS"), os.environ.get("GAEXP_TEST_CPU_QUOTA")
    if cpus:  # the CPUs a process may use; os.cpu_count stays the hardware's, which daemons such as slurmd see
        os.sched_getaffinity = lambda pid: set(range(int(cpus)))
    if quota:
        folder = Path(os.environ.get("GAEXP_TEST_CGROUP") or tempfile.mkdtemp(prefix="gaexp-test-cgroup-"))
        (folder / "cpu.max").write_text(f"{int(quota) * 100000} 100000\n")  # cgroup v2: quota, period (us)
        os.environ["GAEXP_TEST_CGROUP"] = str(folder)
        import gaexp.machine  # light: hydra and omegaconf only (gaexp's __init__ registers the schema)

        gaexp.machine.CGROUP = folder


def seed_stores() -> None:
    template = os.environ.get("GAEXP_TEST_STORE_TEMPLATE")
    if template:
        import importlib.util

        spec = importlib.util.spec_from_file_location("store_template", Path(__file__).with_name("store_template.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.install(template)


apply()
seed_stores()
