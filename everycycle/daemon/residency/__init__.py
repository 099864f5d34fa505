"""Residency: the models resident on this machine's executors and on RPC hosts, and
the room they need, as one concept.

    loaded.py    ``Resident`` (a loaded model, its engine and how it got there) and
                 ``Loading`` (a load under way)
    resident.py  ``Residency``: which models are loaded where; loading (one at a time
                 per model), unloading, idle unloading, engines that die or hang
    room.py      making room: what residents hold, which may go, waiting for busy ones,
                 starting an engine (again on fewer GPU layers); sees the residency
                 through its ``Host`` protocol
    remote.py    RPC hosts: their executors, probed and watched, ordered for placement
    context.py   a request that needs more context than its model was loaded with
"""

from .loaded import Loading, Resident
from .resident import EngineFactory, Residency

__all__ = ["EngineFactory", "Loading", "Residency", "Resident"]
