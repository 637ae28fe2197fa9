"""Trial schedulers (FIFO, ASHA, Hyperband, median stopping) and the Ray Tune plugin.

Importable as ``hfsweep.schedulers``. Nothing is implemented here yet: the sweep engine that
uses schedulers is planned (see the project's issues) and this package exists so the layout and
import path are fixed from the start.
"""

__all__: list[str] = []
