"""hfsweep's version, in a module of its own so that the packages that record it (the
profiler's cache keys and conditions, the CLI) read it without importing the package facade."""

__version__ = "0.1.0.dev0"
