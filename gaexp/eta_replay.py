"""`python -m gaexp.eta_replay`, the name this command was first announced by: it runs `python -m gaexp.tools.eta_replay`
(gaexp/tools/eta_replay.py), with the same arguments."""

import runpy

if __name__ == "__main__":
    runpy.run_module("gaexp.tools.eta_replay", run_name="__main__", alter_sys=True)
