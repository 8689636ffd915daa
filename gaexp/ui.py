"""`python -m gaexp.ui`, the name this command was first announced by: it runs `python -m gaexp.tools.ui`
(gaexp/tools/ui.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.ui", run_name="__main__", alter_sys=True)
