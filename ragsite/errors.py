"""The base of every refusal a client can act on, so that each API renders all of them in one place.

A ``DomainError`` carries what the APIs need: a stable ``code``, the HTTP ``status``, the request
``field`` at fault (if one is) and, for 429 and 503, when to retry (``retry_after_s``). Subclasses
set their defaults as class attributes; ``frontdoors/api/errors.py`` renders them in the REST API's
shape, ``frontdoors/openai_api/errors.py`` in OpenAI's.
"""

from __future__ import annotations


class DomainError(Exception):
    code: str = "invalid_request"
    status: int = 400
    field: str | None = None
    retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        field: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if field is not None:
            self.field = field
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""
