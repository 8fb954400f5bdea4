"""Errors of the OpenAI-compatible API, in OpenAI's shape and statuses.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the status the
official SDKs map to their own exceptions (``openai-python``'s ``_make_status_error``):
400 ``BadRequestError``, 401 ``AuthenticationError``, 403 ``PermissionDeniedError``, 404
``NotFoundError``, 429 ``RateLimitError``, >= 500 ``InternalServerError``; 402 (a spent
budget) becomes the SDK's plain ``APIStatusError``. ``param`` names the request field at
fault, as OpenAI does (``messages``, ``speculative_decoding.draft_tokens``...).

Retries: the SDKs retry 408, 409, 429 and 5xx by themselves (twice by default), waiting
``retry-after-ms`` / ``Retry-After`` when given (at most 60 s). Refusals carry both headers
when we know when to come back, and ``x-should-retry: false`` (which the SDKs obey) when a
retry cannot succeed by itself: no key will come back, a limit of 0 requests, an upstream
that refused the request.
"""

from __future__ import annotations

import math

from django.http import JsonResponse

from inference.errors import RouteNotFound
from ragsite.errors import DomainError

# The error "type" per status, after OpenAI's own names where it has one.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """A request answered with an OpenAI-shaped error. ``retry_after_s``: when to come back
    (``Retry-After``); ``retryable=False`` tells the SDKs not to retry by themselves."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        retryable: bool | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.retryable = retryable

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        if self.retry_after_s is not None:
            response["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            response["retry-after-ms"] = str(max(0, round(self.retry_after_s * 1000)))
        if self.retryable is False:
            response["x-should-retry"] = "false"
        if self.status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="api"'
        return response


def invalid(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 naming the field at fault."""
    return OpenAIError(400, message, param=param, code=code)


_UNSET = object()


def from_domain(error: DomainError, *, param=_UNSET) -> OpenAIError:
    """A refusal of the domain (``ragsite.errors.DomainError``) in OpenAI's shape: its status and
    code (a plain 400 is ``invalid_value``), ``param`` its field unless the caller names the
    request's own, ``Retry-After`` when it says when to retry. A 429 or 503 that cannot say when
    (no key will come back, a limit of 0 requests) tells the SDKs not to retry by themselves. A
    route that does not exist is OpenAI's 404 ``model_not_found``: a route is a model here."""
    if isinstance(error, RouteNotFound):
        return OpenAIError(404, error.message, param="model", code="model_not_found")
    final = error.status in (429, 503) and error.retry_after_s is None
    return OpenAIError(
        error.status,
        error.message,
        param=error.field if param is _UNSET else param,
        code="invalid_value" if error.code == "invalid_request" else error.code,
        retry_after_s=error.retry_after_s,
        retryable=False if final else None,
    )


def model_not_found(model: str, known: list[str]) -> OpenAIError:
    """OpenAI's answer to a model it does not serve: 404, naming the model and what is served."""
    return OpenAIError(
        404,
        f"the model {model!r} does not exist or you do not have access to it: use one of {', '.join(known)}",
        param="model",
        code="model_not_found",
    )


# A generation's terminal ``error`` event (``inference.execution.Failure.as_dict``): its kind
# -> the status a non-streamed request answers.
_GENERATION_STATUS = {
    "unavailable": 503,
    "rate_limited": 503,  # every upstream key rate limited, after the router's own retries
    "invalid_request": 400,
    "timeout": 504,
}


def from_generation(error: dict) -> OpenAIError:
    """A failed generation: 503 when nothing could serve (with ``Retry-After``), 400 for a
    request the backend refused naming a field, 504 for a deadline, 502 otherwise (the
    upstream or the engine failed)."""
    kind = error.get("kind") or "generation_failed"
    status = _GENERATION_STATUS.get(kind, 502)
    retry_after_s = error.get("retry_after_s")
    # The event's own "retryable" is about the same stream (not after tokens were shown); a
    # new request from the client starts afresh, so only what fails everywhere is final.
    final = kind in ("bad_request", "invalid_request") or (kind == "unavailable" and retry_after_s is None)
    return OpenAIError(
        status,
        str(error.get("message") or "the generation failed"),
        param=error.get("field") if status == 400 else None,
        code=kind,
        retry_after_s=retry_after_s,
        retryable=False if final else None,
    )
