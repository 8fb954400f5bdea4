"""The start-up heap out of the garbage collector's way (docs/benchmarks.md, "Gateway overhead").

A web or worker process holds ~170,000 objects once Django, the SDKs and the views are
imported, and CPython's full (generation 2) collection walks all of them: ~75 ms on the
development machine, a pause of every request and stream the process serves, every few
seconds under load. None of those objects is ever garbage: ``gc.freeze()`` moves them to a
permanent generation that collections skip (what Instagram's Django fleet does), so a full
collection walks only what was allocated since. Called once a process has imported what it
serves; the collection before it leaves the start-up's garbage out of the frozen set.

What a full collection still walks is the live state of what the process is serving (a
remote worker's 32 streams: ~30,000 objects, ~45 ms), and in a process that makes little
cyclic garbage it frees next to nothing: ``FullCollectionBackoff`` spaces full collections
out while they find little, and back to CPython's pace as soon as one finds garbage.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass


def startup_heap_freeze() -> None:
    """Collect once, freeze what is left, and pace the full collections from then on."""
    gc.collect()
    gc.freeze()
    FullCollectionBackoff.install()


@dataclass
class FullCollectionBackoff:
    """Adapts how many generation-1 collections come before a full one (the third threshold,
    CPython's default 10) to what the last full collection found.

    A full collection that freed under ``sparse`` of the objects it walked doubles the
    threshold, up to ``most`` (at 640, one full collection in a few minutes of a loaded
    remote worker); one that freed more sets it back to the default. The garbage a sparse
    process leaves waiting is then a few percent of its live heap, while each full
    collection still walks all of it: a pause of every stream, made rare."""

    sparse: float = 0.05
    least: int = 10
    most: int = 640

    @classmethod
    def install(cls) -> FullCollectionBackoff:
        """Once per process: a second call returns the installed one."""
        for callback in gc.callbacks:
            if isinstance(getattr(callback, "__self__", None), cls):
                return callback.__self__
        backoff = cls()
        gc.callbacks.append(backoff.on_collection)
        return backoff

    def on_collection(self, phase: str, info: dict) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        found = info["collected"] + info["uncollectable"]
        # What survived a full collection is all in generation 2 now (the permanent one aside).
        walked = len(gc.get_objects(2)) + found
        first, second, third = gc.get_threshold()
        third = min(self.most, max(self.least, third) * 2) if found < self.sparse * walked else self.least
        gc.set_threshold(first, second, third)
