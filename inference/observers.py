"""What reads a generation while it streams, beside its readers: one observer per request,
chosen by whom the outcome is for (``payload["outcome_to"]["kind"]``), registered by the layer
that owns those requests (search registers the one that verifies an answer's sentences:
``search.answering.streaming``), as ``billing.ledger.outcome_consumer`` registers consumers.

The worker that runs the request hands the observer each delta as it writes it, and writes
the events the observer returns into the same stream; at the end, before the terminal
``stats``, the observer's last events, and what it found goes into the outcome's stats under
``OBSERVED``. An observer that fails is dropped, logged: the generation goes on without it,
and whoever reads the outcome does the observer's work itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

OBSERVED = "observed"


class GenerationObserver(Protocol):
    def delta(self, text: str) -> list[tuple[str, dict]]:
        """The events to write after this delta: ``[(kind, data), ...]``."""

    def end(self) -> tuple[list[tuple[str, dict]], dict]:
        """The generation ended well: the last events, and what goes into the outcome."""


_FACTORIES: dict[str, Callable[[dict], GenerationObserver | None]] = {}


def generation_observer(kind: str):
    """Decorator: ``factory(payload)`` makes the observer of a request whose outcome is for
    ``kind`` (or None: nothing to observe). It runs in the worker, on the request's thread."""

    def register(factory: Callable[[dict], GenerationObserver | None]):
        _FACTORIES[kind] = factory
        return factory

    return register


class Observing:
    """A request's observer as the worker drives it: made at the first delta, dropped at its
    first failure."""

    def __init__(self, request_id: str, payload: dict):
        self.request_id = request_id
        self.payload = payload
        self.observer: GenerationObserver | None = None
        self.started = False

    def delta(self, text: str) -> list[tuple[str, dict]]:
        if not self.started:
            self.started = True
            kind = (self.payload.get("outcome_to") or {}).get("kind")
            factory = _FACTORIES.get(kind)
            if factory is not None:
                self.observer = self._guarded(lambda: factory(self.payload))
        if self.observer is None:
            return []
        return self._guarded(lambda: self.observer.delta(text)) or []

    def end(self) -> tuple[list[tuple[str, dict]], dict | None]:
        if self.observer is None:
            return [], None
        ended = self._guarded(self.observer.end)
        return ended if ended is not None else ([], None)

    def _guarded(self, call):
        try:
            return call()
        except Exception:  # an observer's bug must not fail the generation it observes
            logger.exception("generation %s: its observer failed and was dropped", self.request_id)
            self.observer = None
            return None
