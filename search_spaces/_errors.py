"""The one exception of the search-space language."""

from __future__ import annotations

__all__ = ["SpaceError"]


class SpaceError(ValueError):
    """A search space is not valid, or cannot be used the way it was asked to be.

    The message starts with where the problem is (the file, if any, and the YAML path such as
    ``search_space.lr.low``), then echoes the bad value and says what would be valid. The parts
    are also kept as attributes: :attr:`path` (the YAML path, ``""`` for the space as a whole),
    :attr:`file` (the YAML file, or ``None``) and :attr:`problem` (the message without location).
    """

    def __init__(self, problem: str, *, path: str = "", file: str | None = None) -> None:
        self.problem = problem
        self.path = path
        self.file = file
        where = ": ".join(part for part in (file, path) if part)
        super().__init__(f"{where}: {problem}" if where else problem)

    def __reduce__(self) -> tuple[object, ...]:  # keep path and file through pickling
        return (_rebuild, (self.problem, self.path, self.file))


def _rebuild(problem: str, path: str, file: str | None) -> SpaceError:
    return SpaceError(problem, path=path, file=file)
