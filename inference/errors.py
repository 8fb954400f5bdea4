"""What routing refuses, each with what the API answers (``frontdoors/api/errors.py`` and
``frontdoors/openai_api/errors.py`` render them)."""

from __future__ import annotations

from ragsite.errors import DomainError


class NoRouteConfigured(Exception):
    """No enabled default route: the caller answers without generation (extractive)."""


class PoolWarming(NoRouteConfigured):
    """The route's GPU pool is starting (``Provider.warming_since``): the caller answers
    without generation meanwhile, and says why (``route``: the route that would serve)."""

    def __init__(self, message: str, *, route=None):
        super().__init__(message)
        self.route = route


class RouteNotFound(DomainError, ValueError):
    """A request named a route that does not exist or is disabled."""

    code = "route_not_found"
    field = "route"


class RouteUnavailable(DomainError):
    """Nothing can serve the route now (every key cooling down or disabled, on the route and
    its fallbacks). ``retry_after_s``: when the first key comes back, if one will."""

    code = "route_unavailable"
    status = 503

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message, retry_after_s=retry_after_s)


class SpeculationUnavailable(DomainError, ValueError):
    """No endpoint of the route's model serves the request's speculative options: a 400
    naming ``field`` (speculation is fixed when an engine server starts). A draft model no
    endpoint was started with is a model that is not served: code ``model_not_found``."""

    def __init__(self, field: str, message: str):
        super().__init__(message, field=field, code="model_not_found" if field == "draft_model" else None)
