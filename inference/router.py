"""Where a generation goes: the route, the canary arm, and the queue that runs it.

The web tier calls ``plan`` (which route and arm, sticky per client) and ``submit`` (the
message on queue ``gpu`` for the local pool, ``remote`` for an OpenAI-compatible
upstream). The worker runs ``inference.tasks.generate_routed``, which owns keys, retries
and failover, streams into ``gen:<request_id>`` and writes the ledger row.

The payload carries ids, never secrets: the worker decrypts the key it picks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from inference.models import CanaryRelease, Route
from ragsite.celery import Queue


class NoRouteConfigured(Exception):
    """No enabled default route: the caller answers without generation (extractive)."""


class RouteNotFound(ValueError):
    """A request named a route that does not exist or is disabled."""

    field = "route"


class RouteUnavailable(Exception):
    """Nothing can serve the route now (every key cooling down or disabled, on the route and
    its fallbacks). ``retry_after_s``: when the first key comes back, if one will."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Plan:
    request_id: str
    route: Route  # the route that will serve: the canary's when the arm is "canary"
    requested_route: Route
    release: CanaryRelease | None
    arm: str  # "" without a live release, else "stable" or "canary"


def route_resolve(route_name: str | None) -> Route:
    routes = Route.objects.select_related("provider").filter(enabled=True, provider__enabled=True)
    if route_name:
        route = routes.filter(name=route_name).first()
        if route is None:
            names = ", ".join(routes.values_list("name", flat=True)) or "none"
            raise RouteNotFound(f"no enabled route named {route_name!r} (enabled routes: {names})")
        return route
    route = routes.filter(is_default=True).first()
    if route is None:
        raise NoRouteConfigured("no default route is configured; add a provider and a default route in the admin")
    return route


def plan(*, route_name: str | None = None, client_id: str = "", request_id: str | None = None) -> Plan:
    from inference import canary

    requested = route_resolve(route_name)
    release, arm = canary.arm_for(requested, client_id)
    serving = release.canary_route if arm == canary.CANARY else requested
    return Plan(
        request_id=request_id or uuid.uuid4().hex,
        route=serving,
        requested_route=requested,
        release=release,
        arm=arm,
    )


def queue_for(route: Route) -> str:
    return Queue.GPU.value if route.provider.is_local else Queue.REMOTE.value


def submit(
    plan: Plan,
    *,
    messages: list[dict],
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    stop: tuple[str, ...] | list[str] = (),
    seed: int | None = None,
    workspace_id: int | None = None,
    user_id: int | None = None,
    link=None,
) -> None:
    """Enqueue the generation; the route's defaults fill what the request leaves out.

    ``link``: a Celery signature called with the task's result dict (see
    ``inference.tasks.generate_routed``) once the generation has ended, however it ended.
    """
    from inference.tasks import generate_routed

    route = plan.route
    payload = {
        "route_id": route.id,
        "requested_route_id": plan.requested_route.id,
        "release_id": plan.release.id if plan.release else None,
        "arm": plan.arm,
        "messages": messages,
        "max_tokens": max_tokens if max_tokens is not None else route.max_tokens,
        "temperature": temperature if temperature is not None else route.temperature,
        "top_p": top_p if top_p is not None else route.top_p,
        "stop": list(stop),
        "seed": seed,
        "workspace_id": workspace_id,
        "user_id": user_id,
    }
    generate_routed.apply_async((plan.request_id, payload), queue=queue_for(route), link=link)
