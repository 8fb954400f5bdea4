"""The start-up heap out of the garbage collector's way (docs/benchmarks.md, "Gateway overhead").

A web or worker process holds ~170,000 objects once Django, the SDKs and the views are
imported, and CPython's full (generation 2) collection walks all of them: ~75 ms on the
development machine, a pause of every request and stream the process serves, every few
seconds under load. None of those objects is ever garbage: ``gc.freeze()`` moves them to a
permanent generation that collections skip (what Instagram's Django fleet does), so a full
collection walks only what was allocated since. Called once a process has imported what it
serves; the collection before it leaves the start-up's garbage out of the frozen set.
"""

from __future__ import annotations

import gc


def startup_heap_freeze() -> None:
    """Collect once, then freeze what is left."""
    gc.collect()
    gc.freeze()
