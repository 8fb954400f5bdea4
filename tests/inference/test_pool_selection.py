"""Choosing among GPU pools and their devices.

- ``Provider.speculation_mismatch`` and ``inference.router.provider_for_speculation``: a
  request's speculative options (``{"enabled", "draft_model", "k"}``) are served by the
  route's pool when it decodes that way, else by a sibling pool of the same model and kind
  (speculation is fixed when an engine server starts), else refused naming the field.
  Database rows only: these pools never serve.
- ``inference.backpressure.pool_admit`` (``PoolFull``) and ``inference.pool.device_pick``,
  against real engine servers (``python -m inference.engine.server``, our engine behind the
  OpenAI protocol, batch 1: one sequence decodes while the others wait, which its
  ``/metrics`` reports as vLLM does).
"""

from __future__ import annotations

import functools
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from inference import pool, router
from inference.backpressure import PoolFull, pool_admit
from inference.errors import RouteUnavailable, SpeculationUnavailable
from inference.models import Provider, Route
from inference.router import provider_for_speculation
from tests.inference.tiny_models import tiny_model_save
from tests.pools import closed_device, engine_serving

MODEL = "tiny-pool"


def engine_load(url: str) -> tuple[int, int]:
    """(running, waiting) as the server's ``/metrics`` says now, read past any cache."""
    load = pool.device_probe(url)
    assert load.up, load.error
    return load.running, load.waiting


def wait_for_load(url: str, running: int, waiting: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (seen := engine_load(url)) != (running, waiting):
        assert time.monotonic() < deadline, f"{url}: (running, waiting) is {seen}, not {(running, waiting)}"
        time.sleep(0.05)


@contextmanager
def occupied(url: str, requests: int) -> Iterator[None]:
    """``requests`` streamed completions (the official client) held open on the server and
    left unread: at batch 1 one decodes (thousands of tokens: it outlasts the test) and the
    rest wait. Closing them frees the server, which this waits for."""
    client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=60)
    streams = []
    try:
        for _ in range(requests):
            # The server answers with its headers at once; tokens come once the sequence runs.
            streams.append(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "the wing flow of the shock wave"}],
                    max_tokens=8000,
                    temperature=0,
                    stream=True,
                )
            )
        yield
    finally:
        for stream in streams:
            stream.close()
        client.close()
        wait_for_load(url, 0, 0)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Two engine servers (devices) of one tiny model with room for 8000-token answers."""
    folder = tmp_path_factory.mktemp("pool-selection")
    model = tiny_model_save(folder / "model", 3, max_positions=8192)
    with (
        engine_serving(model, folder / "busy.log") as busy,
        engine_serving(model, folder / "idle.log") as idle,
    ):
        yield {"busy": busy, "idle": idle}


@pytest.fixture
def fresh_loads(monkeypatch):
    """This process's device readings start empty, and one reading lasts the test (60 s
    instead of ``LOAD_MAX_AGE_S``), so that what ``device_pick`` adds to it is what decides."""
    monkeypatch.setattr(pool, "_loads", pool._Loads())
    monkeypatch.setattr(pool, "devices_load", functools.partial(pool.devices_load, max_age=60))


# --------------------------------------------------------------------------- speculation


def pool_make(name: str, *, method: str = "off", k: int = 4, draft: str = "", model: str = MODEL, **fields):
    fields.setdefault("devices", ["http://127.0.0.1:9/v1"])  # never serves
    return Provider.objects.create(
        name=name,
        kind=Provider.Kind.LOCAL,
        model=model,
        speculative_method=method,
        speculative_k=k,
        draft_model=draft,
        **fields,
    )


@pytest.fixture
def pools(db) -> dict:
    """A default route on an n-gram pool (k=4), with a plain and a draft sibling of its model."""
    ngram = pool_make("ngram-pool", method="ngram")
    plain = pool_make("plain-pool")
    drafted = pool_make("draft-pool", method="draft", draft="tiny-draft")
    route = Route.objects.create(name="default", provider=ngram, is_default=True, max_tokens=64)
    return {"route": route, "ngram": ngram, "plain": plain, "draft": drafted}


@pytest.mark.parametrize(
    ("provider", "wanted", "mismatch"),
    [
        ("ngram", {}, None),
        ("ngram", {"enabled": None, "draft_model": None, "k": None}, None),
        ("ngram", {"enabled": True}, None),
        ("ngram", {"k": 4}, None),
        ("ngram", {"enabled": False}, ("enable_speculative", "ngram-pool decodes speculatively (ngram)")),
        ("ngram", {"draft_model": "tiny-draft"}, ("draft_model", "ngram-pool has no draft model, not 'tiny-draft'")),
        ("ngram", {"k": 8}, ("speculative_decoding.draft_tokens", "ngram-pool proposes 4 tokens a step, not 8")),
        ("plain", {"enabled": False}, None),
        ("plain", {}, None),
        ("plain", {"enabled": True}, ("enable_speculative", "plain-pool does not decode speculatively")),
        # A draft model or k asks for speculation.
        ("plain", {"k": 4}, ("enable_speculative", "plain-pool does not decode speculatively")),
        ("plain", {"draft_model": "tiny-draft"}, ("enable_speculative", "plain-pool does not decode speculatively")),
        ("draft", {"draft_model": "tiny-draft", "k": 4}, None),
        ("draft", {"draft_model": "other"}, ("draft_model", "draft-pool serves the draft 'tiny-draft', not 'other'")),
        ("draft", {"enabled": False}, ("enable_speculative", "draft-pool decodes speculatively (draft)")),
    ],
)
def test_speculation_mismatch_names_the_requests_field(pools, provider, wanted, mismatch):
    assert pools[provider].speculation_mismatch(wanted) == mismatch


def test_the_route_serves_options_its_own_pool_meets(pools):
    assert provider_for_speculation(pools["route"], {"k": 4}) == pools["ngram"]
    assert provider_for_speculation(pools["route"], {"enabled": True}) == pools["ngram"]


def test_speculation_off_goes_to_the_plain_sibling(pools):
    assert provider_for_speculation(pools["route"], {"enabled": False}) == pools["plain"]


def test_a_named_draft_model_goes_to_the_pool_that_serves_it(pools):
    assert provider_for_speculation(pools["route"], {"draft_model": "tiny-draft"}) == pools["draft"]


def test_a_k_no_pool_of_the_model_proposes_is_refused_naming_the_field(pools):
    with pytest.raises(SpeculationUnavailable) as refused:
        provider_for_speculation(pools["route"], {"k": 8})
    assert isinstance(refused.value, ValueError)
    assert refused.value.field == "speculative_decoding.draft_tokens"
    assert str(refused.value) == (
        "route 'default' cannot serve these speculative options: ngram-pool proposes 4 tokens a step, not 8, "
        "and no other endpoint of model 'tiny-pool' does (others: draft-pool (draft, k=4), plain-pool (off, k=4))"
    )


def test_a_disabled_sibling_is_never_chosen(pools):
    Provider.objects.filter(id=pools["plain"].id).update(enabled=False)
    with pytest.raises(SpeculationUnavailable) as refused:
        provider_for_speculation(pools["route"], {"enabled": False})
    assert refused.value.field == "enable_speculative"
    assert str(refused.value).endswith("(others: draft-pool (draft, k=4))")


def test_a_sibling_of_another_model_or_kind_is_never_chosen(db):
    ngram = pool_make("ngram-pool", method="ngram")
    pool_make("other-model-pool", model="tiny-other")
    Provider.objects.create(
        name="upstream-same-model", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", model=MODEL
    )
    route = Route.objects.create(name="default", provider=ngram, max_tokens=64)
    with pytest.raises(SpeculationUnavailable) as refused:
        provider_for_speculation(route, {"enabled": False})
    assert refused.value.field == "enable_speculative"
    assert str(refused.value).endswith("of model 'tiny-pool' does (there is no other)")


def test_among_siblings_that_serve_the_options_the_first_by_name_is_chosen(pools):
    first = pool_make("a-plain-pool")
    assert provider_for_speculation(pools["route"], {"enabled": False}) == first


@pytest.mark.django_db(transaction=True)
def test_submit_sends_the_chosen_pool_to_the_gpu_queue_or_refuses_before_sending(pools, monkeypatch):
    sent = []
    monkeypatch.setattr("inference.tasks.generate_routed.apply_async", lambda *a, **k: sent.append((a, k)))
    messages = [{"role": "user", "content": "the wing"}]

    plan = router.plan(client_id="tests", speculative={"enabled": False, "draft_model": None, "k": None})
    router.submit(plan, messages=messages)
    router.submit(router.plan(client_id="tests", speculative={"k": 4}), messages=messages)
    with pytest.raises(SpeculationUnavailable):  # refused when planned: nothing is sent
        router.plan(client_id="tests", speculative={"k": 8})

    [(args, options), (own_args, own_options)] = sent
    (request_id, payload), queue = args[0], options["queue"]
    assert (request_id, queue, payload["route_id"], payload["provider_id"]) == (
        plan.request_id,
        "gpu",
        pools["route"].id,
        pools["plain"].id,
    )
    assert payload["speculative"] == {"enabled": False, "draft_model": None, "k": None}
    # The route's own pool serves: no provider in the payload.
    assert (own_options["queue"], own_args[0][1]["provider_id"]) == ("gpu", None)


# --------------------------------------------------------------------------- admission on the engines' queues


@pytest.mark.slow
@pytest.mark.django_db
def test_pool_admit_refuses_while_the_engines_hold_their_bound_of_waiting_requests(engines, settings, fresh_loads):
    busy = engines["busy"]
    provider = pool_make("busy-pool", devices=[busy])
    retry_after = float(settings.GENERATION_QUEUE_RETRY_AFTER_S)

    with occupied(busy, 3):
        wait_for_load(busy, running=1, waiting=2)

        settings.GPU_POOL_MAX_WAITING = 1
        with pytest.raises(PoolFull) as full:
            pool_admit(provider)
        assert isinstance(full.value, RouteUnavailable)
        assert (full.value.pool, full.value.waiting, full.value.limit, full.value.retry_after_s) == (
            "busy-pool",
            2,
            1,
            retry_after,
        )
        assert str(full.value) == (
            "the service is at capacity: 2 generations are waiting in pool 'busy-pool''s engines "
            f"(the limit is 1); try again in {retry_after:g} s"
        )
        settings.GPU_POOL_MAX_WAITING = 2  # at the bound: refused
        with pytest.raises(PoolFull):
            pool_admit(provider)
        settings.GPU_POOL_MAX_WAITING = 3  # under it: admitted
        pool_admit(provider)
        settings.GPU_POOL_MAX_WAITING = 0  # no bound
        pool_admit(provider)

        # The bound is per device that answers: an idle one doubles it, a closed one adds nothing.
        settings.GPU_POOL_MAX_WAITING = 1
        provider.devices = [busy, closed_device()]
        with pytest.raises(PoolFull) as full:
            pool_admit(provider)
        assert (full.value.waiting, full.value.limit) == (2, 1)
        provider.devices = [busy, engines["idle"]]
        with pytest.raises(PoolFull) as full:
            pool_admit(provider)
        assert (full.value.waiting, full.value.limit) == (2, 2)
        settings.GPU_POOL_MAX_WAITING = 2
        pool_admit(provider)  # 2 waiting < 2 per device x 2 devices

    # The engine drained: admitted at the tightest bound (once this process reads it again).
    settings.GPU_POOL_MAX_WAITING = 1
    loads = pool.devices_load(provider.devices, fresh=True)
    assert [(load.up, load.running, load.waiting) for load in loads] == [(True, 0, 0), (True, 0, 0)]
    pool_admit(provider)


@pytest.mark.django_db
def test_a_pool_with_no_device_answering_is_not_refused_here(settings, fresh_loads):
    settings.GPU_POOL_MAX_WAITING = 1
    pool_admit(pool_make("dark-pool", devices=[closed_device(), closed_device()]))


# --------------------------------------------------------------------------- the device a generation goes to


@pytest.mark.slow
def test_device_pick_sends_to_the_least_loaded_device(engines, fresh_loads):
    busy, idle = engines["busy"], engines["idle"]
    with occupied(busy, 2):
        wait_for_load(busy, running=1, waiting=1)
        picks = [pool.device_pick([busy, idle]) for _ in range(3)]
        # busy: 2 on its server; idle: 0, then 1 and 2 sent by this process since its reading.
        assert picks == [idle, idle, busy]  # at 2 against 2, the first listed
        # Now busy has 2 + 1 sent, idle 0 + 2.
        assert pool.device_pick([busy, idle]) == idle
    assert urllib.request.urlopen(f"{pool.server_root(busy)}/health", timeout=5).status == 200


@pytest.mark.slow
def test_device_pick_passes_over_a_device_that_does_not_answer(engines, fresh_loads):
    idle, closed = engines["idle"], closed_device()
    assert pool.device_pick([closed, idle]) == idle
    [load] = pool.devices_load([closed])
    assert not load.up and load.error.startswith("ConnectError")
    # None answering: the first listed, so that the attempt fails with the connection's reason.
    other = closed_device()
    assert pool.device_pick([other, closed]) == other


@pytest.mark.slow
def test_a_device_an_attempt_could_not_reach_is_passed_over_until_its_next_reading(engines, fresh_loads):
    busy, idle = engines["busy"], engines["idle"]
    assert pool.device_pick([idle, busy]) == idle  # both at rest: the first listed
    pool.device_failed(idle, "ConnectError: [Errno 111] Connection refused")
    assert pool.device_pick([idle, busy]) == busy
    [load] = pool.devices_load([idle])
    assert (load.up, load.error) == (False, "ConnectError: [Errno 111] Connection refused")
    # Its next reading (here forced) finds it up again.
    [load] = pool.devices_load([idle], fresh=True)
    assert load.up
