"""Waiting in tests for what other processes do, without sleeping a guessed time."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, message):
    """The first truthy value of ``predicate()`` polled every 0.1 s, or AssertionError with
    ``message`` (a string, or a callable for one built late) once ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(0.1)
