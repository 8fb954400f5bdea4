"""The GPU pool's devices: their engine servers' load and health, and the choice of one.

A pool is a ``Provider`` of kind ``local`` whose ``devices`` are the base URLs of engine
servers, one per GPU (vLLM's OpenAI-compatible server; ``inference.engine.server`` where
vLLM cannot run). A device's load is what its server says on ``/metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``), read at most every
``LOAD_MAX_AGE_S`` per process: the gpu workers pick the least loaded device with it,
and the web tier admits a new generation against the engines' own queues
(``inference.backpressure.pool_admit``). docs/architecture.md, "The GPU pool".

Requests that begin alike go to the same device, whose prefix cache then holds their
beginning, while its load stays within ``GPU_POOL_AFFINITY_BALANCE`` of the pool's mean
(``device_pick``; docs/scaling.md, "Several devices").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2
from django.conf import settings

# A device's load is reused this long by a process before its /metrics is read again.
LOAD_MAX_AGE_S = 0.5
PROBE_TIMEOUT_S = 2.0
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class DeviceLoad:
    url: str  # the device's base URL, as the provider lists it
    up: bool
    running: int = 0
    waiting: int = 0
    error: str = ""  # why it is not up

    @property
    def busy(self) -> int:
        return self.running + self.waiting


def server_root(base_url: str) -> str:
    """``http://host:port`` of a base URL such as ``http://host:port/v1``: where the engine
    server answers ``/health`` and ``/metrics``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


_http_lock = threading.Lock()
_http: dict = {}


def _client() -> httpx2.Client:
    with _http_lock:
        client = _http.get("client")
        if client is None:
            client = httpx2.Client(timeout=PROBE_TIMEOUT_S)
            _http["client"] = client
        return client


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


def device_probe(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> DeviceLoad:
    """Read one device's ``/metrics``; not up (with the reason) when it does not answer 200."""
    try:
        response = _client().get(f"{server_root(url)}/metrics", timeout=timeout)
    except httpx2.HTTPError as exc:
        return DeviceLoad(url, up=False, error=_reason(exc))
    if response.status_code != 200:
        return DeviceLoad(url, up=False, error=f"/metrics answered HTTP {response.status_code}")
    try:
        running, waiting = _gauges(response.text)
    except ValueError as exc:
        return DeviceLoad(url, up=False, error=f"unreadable /metrics ({exc})")
    return DeviceLoad(url, up=True, running=running, waiting=waiting)


def _gauges(text: str) -> tuple[int, int]:
    """The sums of ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` over their
    label sets, from Prometheus text: only those samples' lines are parsed."""
    counts = {RUNNING: 0.0, WAITING: 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name in counts:
            value = rest.rsplit("}", 1)[-1].split()[0] if "}" in rest else rest.split()[0]
            counts[name] += float(value)
    return int(counts[RUNNING]), int(counts[WAITING])


def device_health(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> str:
    """ "" when the device's server answers ``/health`` with 200, else why not (readiness)."""
    try:
        response = _client().get(f"{server_root(url)}/health", timeout=timeout)
    except httpx2.HTTPError as exc:
        return _reason(exc)
    return "" if response.status_code == 200 else f"/health answered HTTP {response.status_code}"


class _Loads:
    """This process's latest load of each device, the generations it sent to each since that
    are still in progress, and the devices being read again in the background."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loads: dict[str, tuple[float, DeviceLoad]] = {}
        self.sent_since: dict[str, int] = {}
        self.readings: dict[str, int] = {}  # how many times each device was read: a reading's number
        self.refreshing: set[str] = set()

    def get(self, urls: list[str], max_age: float, fresh: bool) -> list[DeviceLoad]:
        now = time.monotonic()
        with self.lock:
            unknown = [url for url in urls if fresh or url not in self.loads]
            stale = [url for url in urls if url not in unknown and now - self.loads[url][0] > max_age]
            stale = [url for url in stale if url not in self.refreshing]
            self.refreshing.update(stale)
        for url in stale:
            threading.Thread(target=self._refresh, args=(url,), name="pool-load", daemon=True).start()
        for url in unknown:  # the first reading (nothing to serve yet), or one asked for
            self._store(url, device_probe(url))
        with self.lock:
            return [self.loads[url][1] for url in urls]

    def _refresh(self, url: str) -> None:
        try:
            self._store(url, device_probe(url))
        finally:
            with self.lock:
                self.refreshing.discard(url)

    def _store(self, url: str, load: DeviceLoad) -> None:
        with self.lock:
            self.loads[url] = (time.monotonic(), load)
            self.sent_since[url] = 0
            self.readings[url] = self.readings.get(url, 0) + 1

    def sent(self, url: str) -> int:
        """Count a generation sent to ``url``; returns the number of the reading it came after."""
        with self.lock:
            self.sent_since[url] = self.sent_since.get(url, 0) + 1
            return self.readings.get(url, 0)

    def finished(self, url: str, reading: int) -> None:
        """A generation sent after reading number ``reading`` has ended: no longer counted, unless
        a newer reading has counted it already (or its end) in the server's own figures."""
        with self.lock:
            if self.readings.get(url, 0) == reading and self.sent_since.get(url, 0) > 0:
                self.sent_since[url] -= 1

    def down(self, url: str, reason: str) -> None:
        with self.lock:
            self.loads[url] = (time.monotonic(), DeviceLoad(url, up=False, error=reason))

    def pending(self, url: str) -> int:
        with self.lock:
            return self.sent_since.get(url, 0)


_loads = _Loads()


def _after_fork_in_child() -> None:
    # A forked child has none of its parent's threads (a refresh in flight would never end)
    # and must not share its parent's connections: it starts afresh.
    global _loads, _http_lock
    _loads, _http_lock = _Loads(), threading.Lock()
    _http.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def devices_load(urls: list[str], *, max_age: float = LOAD_MAX_AGE_S, fresh: bool = False) -> list[DeviceLoad]:
    """The load of each device (in ``urls``' order): the latest reading, read again in the
    background once older than ``max_age`` seconds (see the module docstring); ``fresh``:
    read now, on this thread."""
    return _loads.get(list(urls), max_age, fresh)


def prefix_affinity(messages: list[dict]) -> str:
    """The key of the device a request should go to for its prompt's beginning to be in that
    device's prefix cache. A conversation's later turns share their instructions and first
    exchange (search.answering.prompting puts the earlier turns before the sources), so a
    request with earlier turns is keyed by those; a first question shares only the
    instructions, which every device serving the route holds, so it is keyed by itself:
    first questions spread over the devices."""
    turns = [index for index, message in enumerate(messages) if message.get("role") != "system"]
    shared = messages[: turns[2]] if len(turns) > 2 else messages  # up to the first exchange's end
    text = json.dumps([[message.get("role"), message.get("content")] for message in shared], ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def device_ranking(affinity: str, urls: list[str]) -> list[str]:
    """``urls`` in the order ``affinity`` prefers them: rendezvous hashing, each device ranked by
    a hash of the key and its URL, so that a device added or lost moves only the keys it ranks
    first, and the other keys stay on the devices whose caches hold them."""

    def score(url: str) -> bytes:
        return hashlib.blake2b(f"{affinity}\0{url}".encode(), digest_size=8).digest()

    return sorted(urls, key=score, reverse=True)


def device_pick(urls: list[str], *, avoid: frozenset[str] = frozenset(), affinity: str = "") -> str:
    """The device to send the next generation to, among the up ones (``device_use`` counts it
    until it ends). A device's load is its requests running and waiting on its server plus
    those this process sent it since it last read that and that have not ended. With an
    ``affinity`` (``prefix_affinity``), the first device of its ranking whose load, with this
    request, stays within ``GPU_POOL_AFFINITY_BALANCE`` times the mean load of the up devices
    with it (consistent hashing with bounded loads); without one, or that setting 0, the
    least loaded, the first listed among equals. With none up, the first device: the attempt
    then fails with the connection's own reason, and the router retries.

    ``avoid``: devices this request's earlier attempts failed on; another one is chosen while
    one is left (a retry of a prompt that a device could not start in time goes elsewhere),
    else among them."""
    return _pick(urls, avoid, affinity)[0]


@contextmanager
def device_use(urls: list[str], *, avoid: frozenset[str] = frozenset(), affinity: str = "") -> Iterator[str]:
    """``device_pick``'s device, counted in this process's load of it until the block ends."""
    chosen, reading = _pick(urls, avoid, affinity)
    try:
        yield chosen
    finally:
        _loads.finished(chosen, reading)


def _pick(urls: list[str], avoid: frozenset[str], affinity: str) -> tuple[str, int]:
    candidates = [url for url in urls if url not in avoid] or list(urls)
    if len(candidates) == 1:
        chosen = candidates[0]  # nothing to choose: no reading needed
    else:
        loads = {load.url: load.busy + _loads.pending(load.url) for load in devices_load(candidates) if load.up}
        chosen = _chosen(loads, affinity) if loads else candidates[0]
    return chosen, _loads.sent(chosen)


def _chosen(loads: dict[str, int], affinity: str) -> str:
    least = min(loads, key=loads.__getitem__)  # dicts keep the listed order: the first among equals
    balance = settings.GPU_POOL_AFFINITY_BALANCE
    if not affinity or not balance:
        return least
    bound = math.ceil(balance * (sum(loads.values()) + 1) / len(loads))
    return next((url for url in device_ranking(affinity, list(loads)) if loads[url] + 1 <= bound), least)


def device_failed(url: str, reason: str) -> None:
    """An attempt could not reach ``url``: pick other devices until its next reading."""
    _loads.down(url, reason)
