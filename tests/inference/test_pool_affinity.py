"""Several devices in one GPU pool: which device serves a generation (``inference.pool``).

A conversation's later turns go to the device whose prefix cache holds their common
beginning (rendezvous hashing on ``prefix_affinity``) while its load stays within
``GPU_POOL_AFFINITY_BALANCE`` of the pool's mean; a lost device moves only its own keys, and
a request whose device is gone before its first token is served by another, with one
ledger row. The devices are the OpenAI-protocol stand-in (tests/upstream_server.py), which
reports vLLM's load gauges per URL it is reached by, and a second stand-in process that
the test stops.
"""

from __future__ import annotations

import functools
import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import pytest

from inference import pool, router
from inference.execution import run_routed
from tests.inference.routing_helpers import deltas, events_of, ledger_row, route_make, unique
from tests.upstream_server import serving, upstream_log, upstream_script

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEM = {"role": "system", "content": "Answer from the sources."}


def turns(conversation: str, count: int) -> list[dict]:
    """The messages of a conversation's turn ``count`` (1: its first question): the system
    prompt, the earlier exchanges, then the new question with its sources."""
    messages = [SYSTEM]
    for turn in range(1, count):
        messages += [
            {"role": "user", "content": f"{conversation}: question {turn}"},
            {"role": "assistant", "content": f"answer {turn}"},
        ]
    return [*messages, {"role": "user", "content": f"Sources: ...\n\nQuestion: {conversation}: question {count}"}]


def test_a_conversations_later_turns_share_a_key_and_first_questions_each_have_their_own():
    keys = {turn: pool.prefix_affinity(turns("fuel cells", turn)) for turn in (1, 2, 3, 4)}
    # From the second turn on, the system prompt and the first exchange begin every prompt.
    assert keys[2] == keys[3] == keys[4] != keys[1]
    assert pool.prefix_affinity(turns("wing flutter", 2)) != keys[2]
    # First questions share only the system prompt: each is its own key, so they spread.
    assert pool.prefix_affinity(turns("wing flutter", 1)) != keys[1]
    assert pool.prefix_affinity(turns("fuel cells", 1)) == keys[1]


def test_a_device_lost_moves_only_the_keys_it_ranked_first():
    devices = [f"http://vllm-{index}.vllm:8000/v1" for index in range(3)]
    keys = [pool.prefix_affinity(turns(f"conversation {n}", 2)) for n in range(600)]
    first = {key: pool.device_ranking(key, devices)[0] for key in keys}
    shares = sorted(sum(1 for device in first.values() if device == url) for url in devices)
    assert sum(shares) == 600 and shares[0] >= 150 and shares[-1] <= 250, shares  # about a third each

    survivors = [devices[0], devices[2]]
    after = {key: pool.device_ranking(key, survivors)[0] for key in keys}
    moved = [key for key in keys if after[key] != first[key]]
    assert moved and all(first[key] == devices[1] for key in moved)  # only the lost device's keys
    assert len(moved) == sum(1 for device in first.values() if device == devices[1])


@pytest.fixture
def fresh_loads(monkeypatch):
    """This process's device readings start empty and one reading lasts the test."""
    monkeypatch.setattr(pool, "_loads", pool._Loads())
    monkeypatch.setattr(pool, "devices_load", functools.partial(pool.devices_load, max_age=60))


def key_preferring(device: str, devices: list[str], turn: int = 2) -> str:
    """A conversation whose later turns rank ``device`` first."""
    return next(
        name
        for name in (f"conversation {n}" for n in range(1000))
        if pool.device_ranking(pool.prefix_affinity(turns(name, turn)), devices)[0] == device
    )


def held(url: str, count: int, sockets: list[socket.socket]) -> None:
    """``count`` more streamed completions to ``url`` that the stand-in holds before their
    first byte (scripted), each on a socket of its own left open until the test shuts it;
    returns once the device reports them running."""
    secret = f"hold-{uuid.uuid4().hex}"
    upstream_script(url, secret, [{"first_byte_delay_ms": 60000}] * count)
    running = pool.device_probe(url).running
    address = urlsplit(url)
    body = json.dumps({"model": "stand-in-7b", "messages": [{"role": "user", "content": "hold"}], "stream": True})
    request = (
        f"POST {address.path}/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    for _ in range(count):
        sockets.append(socket.create_connection((address.hostname, address.port), timeout=10))
        sockets[-1].sendall(request.encode())
    deadline = time.monotonic() + 30
    while (load := pool.device_probe(url)).running != running + count:
        assert time.monotonic() < deadline, f"{url} runs {load.running}, not {running + count}"
        time.sleep(0.05)


def test_a_conversation_leaves_its_device_only_beyond_its_share_of_the_load(upstream_server, monkeypatch, settings):
    settings.GPU_POOL_AFFINITY_BALANCE = 1.25
    preferred, other = upstream_server, upstream_server.replace("127.0.0.1", "localhost")
    devices = [other, preferred]  # listed second: it is not chosen for coming first
    affinity = pool.prefix_affinity(turns(key_preferring(preferred, devices), 3))
    sockets: list[socket.socket] = []

    def pick() -> str:
        monkeypatch.setattr(pool, "_loads", pool._Loads())  # a fresh reading of both
        return pool.device_pick(devices, affinity=affinity)

    try:
        assert pick() == preferred  # both idle
        held(preferred, 1, sockets)
        # 1 + this one = 2, within 1.25 x the mean with it ((1 + 0 + 1) / 2 = 1, bound 2).
        assert pick() == preferred
        held(preferred, 1, sockets)
        # 2 + 1 = 3 over the bound (1.25 x 3 / 2, 2): the next device of its ranking.
        assert pick() == other
        settings.GPU_POOL_AFFINITY_BALANCE = 0  # off: the least loaded, whatever the key
        assert pool.device_pick(devices, affinity=pool.prefix_affinity(turns("any", 3))) == other
    finally:
        for held_open in sockets:
            held_open.shutdown(socket.SHUT_RDWR)
            held_open.close()
    deadline = time.monotonic() + 30
    while pool.device_probe(preferred).running:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    settings.GPU_POOL_AFFINITY_BALANCE = 1.25
    assert pick() == preferred


def test_a_conversation_stays_on_its_device_and_moves_without_a_loss_when_the_device_is_gone(
    upstream_server, fresh_loads, settings
):
    settings.GPU_POOL_API_KEY = secret = f"pool-{uuid.uuid4().hex}"
    settings.ROUTER_BACKOFF_BASE_S, settings.ROUTER_BACKOFF_MAX_S = 0.1, 0.3
    from inference.models import Provider

    def ask(route, name: str, turn: int):
        request_id = uuid.uuid4().hex
        plan = router.plan(route_name=route.name, client_id="tests")
        messages = turns(name, turn)
        messages[-1]["content"] += f"\nREPLY: turn {turn} answered"
        result = run_routed(request_id, router.payload_for(plan, messages=messages))
        return result, events_of(request_id), ledger_row(request_id)

    with serving() as lost:
        devices = [upstream_server, lost]
        provider = Provider.objects.create(
            name=unique("pool"), kind=Provider.Kind.LOCAL, devices=devices, model="stand-in-7b", total_timeout_s=30
        )
        route = route_make(provider)
        name = key_preferring(lost, devices)
        served = [ask(route, name, turn) for turn in (2, 3)]
        assert [result["stats"]["device"] for result, _, _ in served] == [1, 1]
        assert [len(upstream_log(device, secret)) for device in devices] == [0, 2]
        pool.devices_load(devices)  # the last reading this process has: both up
    # The device is gone; this process still reads it as up, tries it, and moves on.
    result, events, row = ask(route, name, 4)
    assert (result["status"], result["stats"]["device"], result["attempts"]) == ("ok", 0, 2)
    assert "".join(deltas(events)) == "turn 4 answered"
    [retry] = [data for kind, data in events if kind == "retry"]
    assert retry["kind"] == "connection"
    assert (row.status, row.attempts, row.completion_tokens) == ("ok", 2, 3)
    # Its later turns go straight to the device left.
    result, _, row = ask(route, name, 5)
    assert (result["status"], result["stats"]["device"], result["attempts"], row.attempts) == ("ok", 0, 1, 1)
    assert len(upstream_log(upstream_server, secret)) == 2
