"""The check's two errors: input it cannot use (`CheckError`), and NaN or Inf in the step (`NonFiniteError`).
"""

from __future__ import annotations


class CheckError(ValueError):
    """Input the check cannot use (shapes, sizes, a loss or model that fails): one line naming what was expected."""


class NonFiniteError(ArithmeticError):
    """NaN or Inf in the step (the inputs, a module's output, the loss or a gradient): the check cannot say
    anything about it and the step is not safe. `where` says where it first appeared, in one line."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where
