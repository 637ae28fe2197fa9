"""Whether a storage call failed on a lost or refused connection that may pass (a database
restarting or shutting down, a connection it closed): the one test that the storage's retries
(:mod:`~hfsweep.storage.database`) and the study lock (:mod:`~hfsweep.storage.study_lock`,
whose database lock dies with its connection) both make."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["causes", "is_transient"]


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception behind it) is a lost or refused connection that may
    pass: the server restarting or shutting down, a connection it closed, one not yet
    possible. SQLAlchemy raises those as ``OperationalError``, ``InterfaceError`` or an error
    that invalidated the connection; Optuna wraps them in ``StorageInternalError``."""
    from sqlalchemy import exc as sa

    return any(
        isinstance(cause, sa.OperationalError | sa.InterfaceError)
        or (isinstance(cause, sa.DBAPIError) and cause.connection_invalidated)
        for cause in causes(exc)
    )


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then the exceptions behind it (its cause, else its context), each once."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__
