"""Exceptions raised by hfsweep."""

from __future__ import annotations

__all__ = ["FusionError", "LocatedError", "SweepError"]


class FusionError(ValueError):
    """Models cannot be fused into one array, or an array was called with input it cannot take.

    The message names the submodule path (``""`` is the root model), what differs or is unsupported,
    and what would work instead. hfsweep raises this rather than build an array that would train
    differently from the models it was given.
    """


class LocatedError(ValueError):
    """A problem in a YAML document or mapping, located by file and YAML path.

    The message is ``"<file>: <path>: <problem>"`` (the parts that are known): the file, the
    YAML path of the bad entry (``budget.trials``, ``search_space.lr.low``; ``""`` for the
    document as a whole), then the bad value and what would be valid. The parts are kept as
    :attr:`file`, :attr:`path` and :attr:`problem`, and survive pickling.
    """

    def __init__(self, problem: str, *, path: str = "", file: str | None = None) -> None:
        self.problem = problem
        self.path = path
        self.file = file
        where = ": ".join(part for part in (file, path) if part)
        super().__init__(f"{where}: {problem}" if where else problem)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_located, (type(self), self.problem, self.path, self.file))


def _rebuild_located(
    cls: type[LocatedError], problem: str, path: str, file: str | None
) -> LocatedError:
    return cls(problem, path=path, file=file)


class SweepError(Exception):
    """A sweep cannot start or go on: the message says why and what to do."""
