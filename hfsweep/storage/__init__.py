"""Where a sweep's Optuna study lives, and how several drivers share it.

- :mod:`~hfsweep.storage.journal`: the run directory's default storage, a journal file whose
  flushes to disk are grouped, and the repair of a journal whose last record a crash cut short;
- :mod:`~hfsweep.storage.journal_url`: ``storage: journal://PATH``, a journal file that several
  drivers share;
- :mod:`~hfsweep.storage.database`: a database storage (PostgreSQL, MySQL, SQLite): the
  connection check before anything is written, and the retries through a database restart;
- :mod:`~hfsweep.storage.db_url`: a database URL's secrets (``${NAME}`` references, its
  password), kept out of files, logs and messages;
- :mod:`~hfsweep.storage.transient`: whether a storage call failed on a connection lost for a
  while (a database restarting), which the retries and the study lock ride out;
- :mod:`~hfsweep.storage.study_lock`: the lock every driver sharing a study takes, of the
  storage's own kind;
- :mod:`~hfsweep.storage.drivers`: several drivers on one study: who asked each trial, which
  drivers are alive, and one budget.

Nothing here imports the sweep core (:mod:`hfsweep.core`), which opens its study through these
modules; importing the package imports none of them (Optuna is imported where it is used).
"""

__all__: list[str] = []
