"""`python -m gaexp.gpucheck`, the name this command was first announced by: it runs `python -m gaexp.tools.gpucheck`
(gaexp/tools/gpucheck.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.gpucheck", run_name="__main__", alter_sys=True)
