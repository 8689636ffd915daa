"""`python -m gaexp.storegen`, the name this command was first announced by: it runs `python -m gaexp.tools.storegen`
(gaexp/tools/storegen.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.storegen", run_name="__main__", alter_sys=True)
