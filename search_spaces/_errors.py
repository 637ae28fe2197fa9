"""The one exception of the search-space language."""

from __future__ import annotations

from hfsweep._errors import LocatedError

__all__ = ["SpaceError"]


class SpaceError(LocatedError):
    """A search space is not valid, or cannot be used the way it was asked to be.

    The message starts with where the problem is (the file, if any, and the YAML path such as
    ``search_space.lr.low``), then echoes the bad value and says what would be valid. The parts
    are also kept as attributes: :attr:`path` (the YAML path, ``""`` for the space as a whole),
    :attr:`file` (the YAML file, or ``None``) and :attr:`problem` (the message without location).
    """
