"""`python -m gaexp.server`, the name this command was first announced by: it runs `python -m gaexp.tools.server`
(gaexp/tools/server.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.server", run_name="__main__", alter_sys=True)
