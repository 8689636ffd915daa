"""`python -m gaexp.storebench`, the name this command was first announced by: it runs `python -m gaexp.tools.storebench`
(gaexp/tools/storebench.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.storebench", run_name="__main__", alter_sys=True)
