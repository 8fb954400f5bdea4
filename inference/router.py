"""Where a generation goes: the route, the canary arm, and the queue that runs it.

The web tier calls ``plan`` (which route and arm, sticky per client) and ``submit`` (the
message on queue ``gpu`` for the local pool, ``remote`` for an OpenAI-compatible
upstream; ``RouteUnavailable`` first when no key could serve). The worker runs
``inference.tasks.generate_routed`` (``inference.execution``), which owns keys, retries
and failover, streams into ``gen:<request_id>`` and writes the ledger row.

The payload carries ids, never secrets: the worker decrypts the key it picks. The route
lookups are hand-written statements (``ragsite.rows``); a process keeps what it resolved
and, on each request, reads only the routing version (``inference.models.RoutingVersion``,
moved by database triggers on any change a plan depends on) to know it is still current.
See docs/routing.md, "Keys, retries and failover".
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

from inference import backpressure, canary, keypool, pending
from inference.errors import NoRouteConfigured, PoolWarming, RouteNotFound, RouteUnavailable, SpeculationUnavailable
from inference.models import CanaryRelease, Provider, Route
from inference.tasks import generate_routed
from ragsite.logs import current_request_id
from ragsite.rows import Rows, fetch_one


@dataclass(frozen=True)
class Plan:
    request_id: str
    route: Route  # the route that will serve: the canary's when the arm is "canary"
    requested_route: Route
    release: CanaryRelease | None
    arm: str  # "" without a live release, else "stable" or "canary"
    # Whether the serving route's provider had a usable key when planned (None: not known).
    key_usable: bool | None = None
    # The request's speculative options (``{"enabled", "draft_model", "k"}``, None: the route's
    # own), and the endpoint chosen for them when it is not the route's own provider.
    speculative: dict | None = None
    speculating_provider: Provider | None = None

    @property
    def provider(self) -> Provider:
        """The endpoint that serves the request."""
        return self.speculating_provider or self.route.provider


@functools.cache
def _plan_rows() -> Rows:
    return Rows((Route, "r"), (Provider, "p"), (CanaryRelease, "c"), (Route, "cr"), (Provider, "cp"))


# When the provider's keys can next be used, in Unix seconds: 0 with an active key, the
# first cooldown's end with only cooling keys, NULL with none that can come back.
_USABLE_FROM = (
    "(SELECT min(CASE WHEN k.status = 'active' THEN 0 WHEN k.status = 'cooling_down' "
    "THEN EXTRACT(EPOCH FROM k.cooldown_until)::float8 END) FROM inference_upstreamkey k "
    "WHERE k.provider_id = {provider}.id)"
)
_VERSION = "(SELECT version FROM inference_routingversion WHERE id = 1)"


@dataclass(frozen=True)
class Resolved:
    """A route as the plan query found it, with the routing version it was read at.
    Shared by the requests of a process: read only."""

    version: int | None
    route: Route
    release: CanaryRelease | None
    usable_from: float | None  # the route's provider (see _USABLE_FROM)
    canary_usable_from: float | None  # the live release's canary provider


# Per process: the route name (None: the default) -> what the plan query found. A plan
# reuses an entry while the routing version is the one it was read at (one primary-key
# read instead of the join and five model instances: about 0.7 ms a request).
_resolved: dict[str | None, Resolved] = {}


def _query(route_name: str | None) -> Resolved:
    """The enabled route (named, else the default) with its provider and its live canary
    release (with the canary route and provider), when each of the two providers has a
    usable key, and the routing version; one statement, one snapshot."""
    rows = _plan_rows()
    which = "r.name = %s" if route_name else "r.is_default"
    row = fetch_one(
        f"SELECT {rows.columns}, {_USABLE_FROM.format(provider='p')}, {_USABLE_FROM.format(provider='cp')}, "  # noqa: S608
        f"{_VERSION} FROM inference_route r JOIN inference_provider p ON p.id = r.provider_id "
        "LEFT JOIN LATERAL (SELECT * FROM inference_canaryrelease live WHERE live.stable_route_id = r.id "
        "  AND live.state = ANY(%s) ORDER BY live.created_at DESC LIMIT 1) c ON true "
        "LEFT JOIN inference_route cr ON cr.id = c.canary_route_id "
        "LEFT JOIN inference_provider cp ON cp.id = cr.provider_id "
        f"WHERE r.enabled AND p.enabled AND {which} LIMIT 1",
        [[str(state) for state in CanaryRelease.LIVE_STATES], *([route_name] if route_name else [])],
    )
    if row is None:
        if route_name:
            routes = Route.objects.filter(enabled=True, provider__enabled=True)
            names = ", ".join(routes.values_list("name", flat=True)) or "none"
            raise RouteNotFound(f"no enabled route named {route_name!r} (enabled routes: {names})")
        raise NoRouteConfigured("no default route is configured; add a provider and a default route in the admin")
    route, provider, release, canary_route, canary_provider = rows.instances(row)
    route.provider = provider
    if release is not None:
        release.stable_route = route
        canary_route.provider = canary_provider
        release.canary_route = canary_route
    usable_from, canary_usable_from, version = row[rows.width :]
    return Resolved(version, route, release, usable_from, canary_usable_from)


def _resolve(route_name: str | None) -> Resolved:
    cached = _resolved.get(route_name)
    if cached is not None and cached.version is not None:
        current = fetch_one(f"SELECT {_VERSION}", [])
        if current is not None and current[0] == cached.version:
            return cached
    resolved = _query(route_name)
    if resolved.version is not None:  # no version row (an emptied table): nothing to check against
        _resolved[route_name] = resolved
    return resolved


def _usable(usable_from: float | None) -> bool:
    return usable_from is not None and usable_from <= time.time()


def plan(
    *,
    route_name: str | None = None,
    client_id: str = "",
    request_id: str | None = None,
    speculative: dict | None = None,
) -> Plan:
    """The route and arm of a request: the route, its provider, live release, canary route
    and provider, and whether they have a usable key (``_resolve``: one query, or only the
    routing version's when nothing changed since this process last asked), and the sticky
    arm (``canary.arm_of``), decided as ``canary.arm_for`` does. ``PoolWarming`` while the
    serving route's GPU pool is starting.

    ``speculative``: the request's speculative options, checked here and only here against
    the serving route's endpoints (``provider_for_speculation``; ``SpeculationUnavailable``
    names the request's field), before anything of the request is done."""
    resolved = _resolve(route_name)
    requested, release = resolved.route, resolved.release
    if release is None:
        arm = ""
    elif not release.canary_route.enabled or not release.canary_route.provider.enabled:
        arm = canary.STABLE
    else:
        arm = canary.arm_of(release, client_id)
    serving = release.canary_route if arm == canary.CANARY else requested
    if serving.provider.warming_since is not None:
        raise PoolWarming(f"the GPU pool {serving.provider.name} is still starting", route=serving)
    return Plan(
        request_id=request_id or uuid.uuid4().hex,
        route=serving,
        requested_route=requested,
        release=release,
        arm=arm,
        key_usable=_usable(resolved.canary_usable_from if arm == canary.CANARY else resolved.usable_from),
        speculative=speculative or None,
        speculating_provider=provider_for_speculation(serving, speculative) if speculative else None,
    )


def provider_for_speculation(route: Route, wanted: dict) -> Provider:
    """The endpoint that serves a request's speculative options (``Provider.speculation_mismatch``)
    on ``route``: its own provider when it can, else another enabled provider of the same kind
    and model (a GPU pool running another speculative configuration), by name."""
    own = route.provider
    mismatch = own.speculation_mismatch(wanted)
    if mismatch is None:
        return own
    others = Provider.objects.filter(enabled=True, kind=own.kind, model=own.model).exclude(id=own.id).order_by("name")
    for other in others:
        if other.speculation_mismatch(wanted) is None:
            return other
    field, reason = mismatch
    alternatives = ", ".join(f"{p.name} ({p.speculative_method}, k={p.speculative_k})" for p in others)
    raise SpeculationUnavailable(
        field,
        f"route {route.name!r} cannot serve these speculative options: {reason}, and no other endpoint of model "
        f"{own.model!r} does ({'others: ' + alternatives if alternatives else 'there is no other'})",
    )


def check_available(route: Route, *, key_usable: bool | None = None) -> None:
    """Raise ``RouteUnavailable`` when no key of the route's provider or of its fallbacks'
    providers is usable now (all cooling down or disabled, or none at all). A route on the
    local pool, or with a local fallback, is always available. One query when the route's
    own provider has a usable key (the usual case), none when ``key_usable`` says so (from
    the plan, which asked in its own query), two otherwise."""
    if route.provider.is_local or key_usable or (key_usable is None and keypool.has_usable(route.provider_id)):
        return
    available = keypool.availability(route_id=route.id)
    if available.usable == 0 and not available.local:
        message = keypool.unavailable_message(route.name, available)
        retry_after = available.retry_after_s
        raise RouteUnavailable(message, retry_after_s=round(retry_after, 3) if retry_after is not None else None)


def payload_for(
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
    client_key_id: int | None = None,
    admission: dict | None = None,
    outcome_to: dict | None = None,
) -> dict:
    """The task's payload: ids and the request, the route's defaults where the request is silent.

    The plan's speculative options travel with it (its fallbacks must meet them too), and the
    endpoint chosen for them when it is not the route's own."""
    route, provider = plan.route, plan.provider
    return {
        "route_id": route.id,
        "requested_route_id": plan.requested_route.id,
        "release_id": plan.release.id if plan.release else None,
        "arm": plan.arm,
        "messages": messages,
        "max_tokens": max_tokens if max_tokens is not None else route.max_tokens,
        "temperature": temperature if temperature is not None else route.temperature,
        "top_p": top_p if top_p is not None else route.top_p,
        "stop": list(stop) if stop else list(route.stop or ()),
        "seed": seed,
        "workspace_id": workspace_id,
        "user_id": user_id,
        "client_key_id": client_key_id,
        # The client key's admission (billing.limits.Admission.as_json), settled with the ledger row.
        "admission": admission,
        "speculative": plan.speculative,
        "provider_id": provider.id if provider.id != route.provider_id else None,
        # The web request's X-Request-ID (ragsite/logs.py): the ledger row keeps it even when the
        # row is written by a dead worker's parent, which runs no task of this request.
        "trace_id": current_request_id(),
        # Who takes the outcome (``submit``); it travels with the ledger row (billing.ledger).
        "outcome_to": outcome_to,
    }


def capacity_check(plan: Plan) -> None:
    """``PoolFull`` or ``QueueFull`` (503, ``Retry-After``) when what would serve the plan has no
    room now: asked before the request's retrieval, so that past saturation a refusal costs a
    Redis round trip rather than a search. ``submit`` decides again, exactly, at the publish."""
    if plan.provider.is_local:
        backpressure.pool_admit(plan.provider)
    backpressure.queue_room(plan.route.provider.queue)


def submit(plan: Plan, **request) -> None:
    """Enqueue the generation (``request``: the keyword arguments of ``payload_for``) to the
    endpoint the plan chose (``Plan.provider``).

    Raises ``RouteUnavailable`` (with ``retry_after_s``) before enqueueing when every key
    that could serve is cooling down or disabled: the API answers 503 with ``Retry-After``.

    ``outcome_to`` (``{"kind", ...}``): who takes the generation's outcome once it has ended,
    however it ended (its pool process dead, its worker lost): the ledger's drain hands it to
    the consumer registered for that kind (``billing.ledger.outcome_consumer``).
    """
    check_available(plan.route, key_usable=plan.key_usable)
    serving = plan.provider
    payload = payload_for(plan, **request)
    queue = plan.route.provider.queue
    if serving.is_local:  # PoolFull (503, Retry-After) when the pool's engines hold their bound of waiting requests
        backpressure.pool_admit(serving)
    # Overload: QueueFull (a RouteUnavailable: 503, Retry-After) when the queue is at its bound.
    with backpressure.queue_slot(queue):
        # Kept until a worker starts it, so that a message lost as a worker is killed is queued
        # again (inference/pending.py); the task id is the request's, so the queues show it.
        payload["pending"] = True
        pending.recorded(plan.request_id, queue, payload)
        try:
            generate_routed.apply_async((plan.request_id, payload), queue=queue, task_id=plan.request_id)
        except BaseException:
            pending.forget(plan.request_id)
            raise
