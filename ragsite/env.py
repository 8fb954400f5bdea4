"""Typed readers for settings that come from the environment.

Each helper fails loudly: a value that is present but malformed raises
``ImproperlyConfigured`` naming the variable and what was expected, so a typo in a
deployment stops start-up instead of silently falling back to a default.
"""

from __future__ import annotations

import os
from decimal import Decimal, InvalidOperation
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _bad(name: str, expected: str, value: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{name} must be {expected}, got {value!r}")


def env_str(name: str, default: str | None = None, *, required: bool = False) -> str | None:
    value = _raw(name)
    if value is None:
        if required:
            raise ImproperlyConfigured(f"{name} must be set")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _bad(name, "a boolean (true/false, 1/0, yes/no, on/off)", value)


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise _bad(name, "an integer", value) from None
    if minimum is not None and number < minimum:
        raise _bad(name, f"an integer >= {minimum}", value)
    if maximum is not None and number > maximum:
        raise _bad(name, f"an integer <= {maximum}", value)
    return number


def env_float(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise _bad(name, "a number", value) from None
    if minimum is not None and number < minimum:
        raise _bad(name, f"a number >= {minimum}", value)
    if maximum is not None and number > maximum:
        raise _bad(name, f"a number <= {maximum}", value)
    return number


def env_decimal(name: str, default: Decimal) -> Decimal:
    value = _raw(name)
    if value is None:
        return default
    try:
        return Decimal(value)
    except InvalidOperation:
        raise _bad(name, "a decimal number", value) from None


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(item == "" for item in items):
        raise _bad(name, "a comma-separated list without empty items", value)
    return items


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise _bad(name, "one of " + ", ".join(choices), value)
    return value


def env_url(name: str, schemes: tuple[str, ...]) -> str | None:
    """A URL whose scheme is one of ``schemes``; ``None`` when unset."""
    value = _raw(name)
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise _bad(name, "a URL starting with " + " or ".join(f"{s}://" for s in schemes), redact_url(value))
    return value


def redact_url(url: str) -> str:
    """Hide a password in a URL before it goes into an error message."""
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url
