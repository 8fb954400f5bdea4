"""Limit/offset pagination with a maximum page, strict about its parameters.

DRF's ``LimitOffsetPagination`` quietly ignores a malformed ``limit`` and lowers one over
the maximum; here both are a 400 naming the parameter, so that what the OpenAPI schema says
(``1 <= limit <= 200``, ``offset >= 0``) is exactly what is accepted. Pages report the
``limit`` and ``offset`` they were cut with beside ``count``, ``next`` and ``previous``.
"""

from __future__ import annotations

import re

from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response

from frontdoors.api.errors import invalid

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
# Bounded so that the SQL OFFSET stays a bigint.
MAX_OFFSET = 2**62


def query_integer(request, name: str, default: int | None, minimum: int, maximum: int) -> int | None:
    """The integer query parameter ``name`` within bounds, ``default`` when absent; else a 400."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"-?[0-9]{1,20}", raw):  # int() would also take " 5", "5_0" and other scripts' digits
        raise invalid(name, f"{name} must be an integer, got {raw[:40]!r}")
    value = int(raw)
    if not minimum <= value <= maximum:
        raise invalid(name, f"{name} must be from {minimum} to {maximum}, got {value}")
    return value


class ApiPagination(LimitOffsetPagination):
    default_limit = DEFAULT_LIMIT
    max_limit = MAX_LIMIT

    def get_limit(self, request) -> int:
        return query_integer(request, self.limit_query_param, self.default_limit, 1, self.max_limit)

    def get_offset(self, request) -> int:
        return query_integer(request, self.offset_query_param, 0, 0, MAX_OFFSET)

    def get_paginated_response(self, data) -> Response:
        return Response(
            {
                "count": self.count,
                "limit": self.limit,
                "offset": self.offset,
                "next": self.get_next_link(),
                "previous": self.get_previous_link(),
                "results": data,
            }
        )

    def get_paginated_response_schema(self, schema: dict) -> dict:
        page = super().get_paginated_response_schema(schema)
        page["properties"] = {
            "count": page["properties"]["count"],
            "limit": {"type": "integer", "example": DEFAULT_LIMIT},
            "offset": {"type": "integer", "example": 0},
            **{name: value for name, value in page["properties"].items() if name != "count"},
        }
        page["required"] = ["count", "limit", "offset", "next", "previous", "results"]
        return page

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.limit_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_limit, default=self.default_limit)
            else:
                parameter["schema"].update(minimum=0, maximum=MAX_OFFSET, default=0)
        return parameters
