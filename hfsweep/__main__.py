"""``python -m hfsweep``: the same command line as ``hfsweep`` (for an environment whose scripts
folder is not on ``PATH``)."""

from .cli import main

raise SystemExit(main())
