"""The sweeper's error, in a module of its own that Hydra's plugin scan skips: the scan executes every public module
of hydra_plugins/ anew, and a class defined in one would be made twice, so that `except` of the first missed the
second (a sweeper test found it). Its config.py shares it from here."""

from hydra.errors import HydraException


class SweeperError(HydraException):
    """Bad sweeper input: one line naming the value and what is valid."""
