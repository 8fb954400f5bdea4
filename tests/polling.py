"""Waiting in tests for what other processes do, without sleeping a guessed time."""

from __future__ import annotations

import time

# The pause between two calls of a predicate: 0.1 s, or as long as its own call took (one that
# starts a process, ``manage.py shell``, takes seconds of a core), up to this many seconds: polling
# then never takes more than half a core from the processes it waits for.
POLL_S, SLOW_POLL_MAX_S = 0.1, 2.0


def wait_for(predicate, timeout: float, message):
    """The first truthy value of ``predicate()`` polled every 0.1 s (a slow predicate: see POLL_S),
    or AssertionError with ``message`` (a string, or a callable for one built late) once ``timeout``
    seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(max(POLL_S, min(now - started, SLOW_POLL_MAX_S)))
