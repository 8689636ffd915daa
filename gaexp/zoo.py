"""`python -m gaexp.zoo`, the name this command was first announced by: it runs `python -m gaexp.tools.zoo`
(gaexp/tools/zoo.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.zoo", run_name="__main__", alter_sys=True)
