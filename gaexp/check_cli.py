"""`python -m gaexp.check_cli`, the name gaexp-check's module was first announced by: it runs `python -m gaexp.check`
(gaexp/check/cli.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.check.cli", run_name="__main__", alter_sys=True)
