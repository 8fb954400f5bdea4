"""The OpenAPI schema's parts that drf-spectacular cannot infer.

- ``error_responses``: the documented error responses of an operation, all in the one error
  shape (``errors.py``), so that a schema-driven client or fuzzer finds every status the
  endpoint may answer with and its body.
- ``api_v1_only`` (a preprocessing hook): the schema describes this API alone, not the other
  DRF views of the site.
- ``add_answer_stream`` (a postprocessing hook): the answer's Server-Sent Events endpoint is
  a plain async Django view (``streaming.py``), invisible to drf-spectacular; its operation
  is written here.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse

from frontdoors.api.auth import WORKSPACE_SLUG_PATTERN
from frontdoors.api.serializers import ErrorSerializer
from search.answering.answers import EVENT_ID_PATTERN

API_PREFIX = "/api/v1/"

_ERROR_DESCRIPTIONS = {
    400: "Invalid request; `field` names the parameter at fault.",
    401: "No API key or session, or a bad, expired or revoked key (with `WWW-Authenticate: Bearer`).",
    402: "The key's monthly budget is spent (`budget_exhausted`), or its model has no price (`model_unpriced`).",
    403: "The key lacks the scope, or the user is in no workspace.",
    404: "No such object in this workspace (another workspace's objects are not found either), or no such "
    "workspace of yours (`workspace_not_found`).",
    409: "The request conflicts with the object's state.",
    413: "A file is larger than the server accepts (`document_too_large`).",
    415: "Unsupported request body type.",
    429: "Too many requests: `rate_limited`, with `Retry-After` (seconds).",
    503: "No upstream can serve the route now (`route_unavailable`), with `Retry-After` when one comes back.",
}
# What every operation may answer: a bad or unknown workspace, unauthenticated, out of scope, throttled.
COMMON_ERRORS = (400, 401, 403, 404, 429)


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    return {
        status: OpenApiResponse(ErrorSerializer, description=_ERROR_DESCRIPTIONS[status])
        for status in sorted({*COMMON_ERRORS, *statuses})
    }


def api_v1_only(endpoints: list) -> list:
    return [endpoint for endpoint in endpoints if endpoint[0].startswith(API_PREFIX)]


WORKSPACE_PARAMETER = {
    "in": "query",
    "name": "workspace",
    "schema": {"type": "string", "pattern": WORKSPACE_SLUG_PATTERN},
    "description": "A session's workspace (its slug) when the user is a member of several; also the X-Workspace "
    "header. A key's workspace is the key's.",
}


# One event of the stream (OpenAPI 3.0 has an event stream's schema describe each event).
ANSWER_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "delta, progress, retry, stats or error; skip others."},
        "id": {"type": "string", "pattern": r"^\d+-\d+$", "description": "For Last-Event-ID."},
        "data": {"type": "string", "description": "A JSON object: {text} for a delta."},
    },
    "required": ["event", "id", "data"],
}


def _error_content() -> dict:
    return {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}


def add_answer_stream(result: dict, generator, request, public) -> dict:
    """Adds the event-stream operation, and the ``workspace`` parameter to every operation."""
    error_statuses = (400, 401, 403, 404)
    for operations in result["paths"].values():
        for operation in operations.values():
            operation.setdefault("parameters", []).append(WORKSPACE_PARAMETER)
    result["paths"][f"{API_PREFIX}answers/{{answer_id}}/stream"] = {
        "get": {
            "operationId": "answers_stream",
            "summary": "An answer's events, as Server-Sent Events",
            "description": (
                "`event: <type>`, `id: <id>`, `data: <JSON object>` per event: `delta` {text} while the "
                "answer is written, `progress` and `retry` notices, then `stats` (done) or `error` (failed), "
                "which end the stream. Comment lines (`: keep-alive`) come while nothing happens. Resume "
                "after the last id seen with the `Last-Event-ID` header or `?after=`. Scope: generate."
            ),
            "tags": ["answers"],
            "parameters": [
                {"in": "path", "name": "answer_id", "required": True, "schema": {"type": "string", "format": "uuid"}},
                {
                    "in": "query",
                    "name": "after",
                    "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
                    "description": "Send the events after this id (as Last-Event-ID does).",
                },
                {
                    "in": "header",
                    "name": "Last-Event-ID",
                    "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
                    "description": "The last event id seen, sent by EventSource when it reconnects.",
                },
                WORKSPACE_PARAMETER,
            ],
            "responses": {
                "200": {
                    "description": "The event stream.",
                    "content": {"text/event-stream": {"schema": ANSWER_EVENT}},
                },
                "204": {"description": "The stream had ended at `Last-Event-ID`: nothing more will come."},
                **{
                    str(status): {"description": _ERROR_DESCRIPTIONS[status], "content": _error_content()}
                    for status in error_statuses
                },
            },
            "security": [{"apiKey": []}, {"cookieAuth": []}],
        }
    }
    return result
