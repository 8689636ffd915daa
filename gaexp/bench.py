"""`python -m gaexp.bench`, the name this command was first announced by: it runs `python -m gaexp.tools.bench`
(gaexp/tools/bench.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.bench", run_name="__main__", alter_sys=True)
