"""`python -m gaexp.drift`, the name this command was first announced by: it runs `python -m gaexp.tools.drift`
(gaexp/tools/drift.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.drift", run_name="__main__", alter_sys=True)
