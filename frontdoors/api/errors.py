"""The API's one error shape, ``{"error": {"code", "message", "field"?}}``, for every failure.

``api_exception_handler`` is the exception handler of the API's DRF views (set on their base
class, not globally, so other DRF views keep their own shapes). It renders DRF's own errors
(401, 403, 404, 405, 406, 415, 429, validation) and every refusal of the domain
(``ragsite.errors.DomainError``: its status, code, field and ``Retry-After``); an outage of
PostgreSQL or Redis is a 503; anything else is a 500 ``server_error``, logged with its
traceback (the body says nothing more).

401s carry ``WWW-Authenticate: Bearer realm="api"`` (RFC 6750). ``error_json`` is the same
shape for the plain Django views (the event stream, unknown paths).
"""

from __future__ import annotations

import logging
import math

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from ragsite.errors import DomainError
from ragsite.outages import RETRY_AFTER_S, log_outage, outage_message, outage_of

logger = logging.getLogger(__name__)

WWW_AUTHENTICATE = 'Bearer realm="api"'
INVALID_REQUEST = "invalid_request"


class RestApiError(exceptions.APIException):
    """An error with its HTTP status, a stable ``code``, the request ``field`` at fault (if
    one is) and, for 429 and 503, when to retry (``retry_after_s``)."""

    def __init__(
        self, status_code: int, code: str, message: str, *, field: str | None = None, retry_after_s=None
    ) -> None:
        super().__init__(detail=message, code=code)
        self.status_code = status_code
        self.code = code
        self.field = field
        self.retry_after_s = retry_after_s


def invalid(field: str | None, message: str) -> RestApiError:
    """A 400 naming the request field at fault."""
    return RestApiError(status.HTTP_400_BAD_REQUEST, INVALID_REQUEST, message, field=field)


def retry_after_header(seconds) -> str:
    """Whole seconds, rounded up and at least 1: a client that waits that long may retry."""
    return str(max(1, math.ceil(float(seconds))))


def error_body(code: str, message: str, field: str | None = None) -> dict:
    error = {"code": code, "message": message}
    if field:
        error["field"] = field
    return {"error": error}


def _headers(error: RestApiError) -> dict[str, str]:
    headers = {}
    if error.status_code == status.HTTP_401_UNAUTHORIZED:
        headers["WWW-Authenticate"] = WWW_AUTHENTICATE
    if error.retry_after_s is not None:
        headers["Retry-After"] = retry_after_header(error.retry_after_s)
    return headers


def error_json(error: RestApiError, headers: dict[str, str] | None = None) -> JsonResponse:
    """The error shape from a plain Django view."""
    return JsonResponse(
        error_body(error.code, str(error.detail), error.field),
        status=error.status_code,
        headers={**_headers(error), **(headers or {})},
    )


def api_error_of(exc: Exception) -> RestApiError | None:
    """Any exception the API knows as an ``RestApiError``; None for anything else (a bug: 500)."""
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, RestApiError):
        return exc
    if isinstance(exc, exceptions.ValidationError):
        return _validation_error(exc)
    if isinstance(exc, exceptions.Throttled):
        return RestApiError(exc.status_code, "rate_limited", str(exc.detail), retry_after_s=exc.wait)
    if isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        return RestApiError(exc.status_code, codes if isinstance(codes, str) else exc.default_code, str(exc.detail))
    if isinstance(exc, DomainError):
        return RestApiError(exc.status, exc.code, exc.message, field=exc.field, retry_after_s=exc.retry_after_s)
    if service := outage_of(exc):
        return RestApiError(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "service_unavailable",
            outage_message(service),
            retry_after_s=RETRY_AFTER_S,
        )
    return None


def _first_error(detail, path: tuple = ()) -> tuple[tuple, exceptions.ErrorDetail | str]:
    """The first message of a validation error's nested detail, with where it is."""
    if isinstance(detail, dict) and detail:
        key, value = next(iter(detail.items()))
        return _first_error(value, (*path, key))
    if isinstance(detail, list) and detail:
        return _first_error(detail[0], path)
    return path, detail


def _validation_error(exc: exceptions.ValidationError) -> RestApiError:
    path, message = _first_error(exc.detail)
    field = str(path[0]) if path and path[0] != "non_field_errors" else None
    if len(path) > 1:  # an item of a list or an object's member
        message = f"{'.'.join(map(str, path[1:]))}: {message}"
    return invalid(field, str(message))


def api_exception_handler(exc: Exception, context: dict) -> Response:
    """DRF's exception handler for the API's views: see the module docstring."""
    error = api_error_of(exc)
    if service := outage_of(exc):
        log_outage(service, context["request"], exc)
    if error is None:
        view = context.get("view")
        logger.error("API request failed in %s", type(view).__name__ if view else "a view", exc_info=exc)
        error = RestApiError(
            status.HTTP_500_INTERNAL_SERVER_ERROR,
            "server_error",
            "The server failed to handle this request; the failure is logged.",
        )
    set_rollback()
    return Response(
        error_body(error.code, str(error.detail), error.field), status=error.status_code, headers=_headers(error)
    )
