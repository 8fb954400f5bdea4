"""The users of the load benchmark: ``benchmarks/load.py`` runs locust headless on this file,
in a process of its own (gevent's monkey-patching stays there), with its settings as JSON in
``LOAD_CONFIG``:

- ``scenario``: ``search`` (``POST /api/v1/search``, hybrid, top 10) or ``answers``
  (``POST /v1/chat/completions``, not streamed: the request ends with the whole answer);
- ``levels`` (users at each step), ``level_s`` (seconds per step);
- ``tokens`` (client keys, taken in turn by every request), ``queries``, ``model``,
  ``max_tokens``, ``timeout_s`` (a client gives up on a request after this long);
- ``out``: where to write every request, at the end.

Users are closed-loop with no think time: each sends its next request as soon as the last
one is answered, except after a refusal with ``Retry-After``, which it waits out first as the
OpenAI SDKs do (``honor_retry_after``; false: at once, as a careless client would). ``StepLevels`` holds each level for
``level_s`` seconds, then adds users up to the next one; after the last, users send nothing more
and the run stops once their requests in flight are answered (at most ``timeout_s``). Every request is
recorded as ``[start (Unix s), milliseconds, HTTP status (0: no response), Retry-After]``;
``load.py`` assigns it to the level it started in.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from locust import FastHttpUser, LoadTestShape, events, task

CONFIG = json.loads(os.environ["LOAD_CONFIG"])
RECORDS: list[list] = []
_tokens = itertools.cycle(CONFIG["tokens"])
_queries = itertools.cycle(CONFIG["queries"])


@events.request.add_listener
def record(start_time, response_time, response, **_):
    status = getattr(response, "status_code", 0) or 0
    headers = getattr(response, "headers", None) or {}
    RECORDS.append([start_time, response_time, status, headers.get("Retry-After")])


@events.quitting.add_listener
def write(**_):
    with open(CONFIG["out"], "w") as handle:
        json.dump(RECORDS, handle)


# When the levels end: users send nothing more, and the run waits for the requests in flight
# (at most ``timeout_s``). Stopped at once, locust drops them unrecorded: at 128 users with
# answers taking 5 s, most of the last level's requests were lost from its count.
LEVELS_END_S = len(CONFIG["levels"]) * CONFIG["level_s"]
_in_flight = 0


def _retry_after_s(response) -> float | None:
    """The wait a refusal asks for, read as the OpenAI SDKs read it: ``retry-after-ms`` first,
    then ``Retry-After`` in seconds; a value outside (0, 60] s is not waited for."""
    for header, scale in (("retry-after-ms", 1000), ("Retry-After", 1)):
        try:
            seconds = float(response.headers.get(header, "")) / scale
        except ValueError:
            continue
        return seconds if 0 < seconds <= 60 else None
    return None


class StepLevels(LoadTestShape):
    def tick(self):
        run_time = self.get_run_time()
        if run_time >= LEVELS_END_S:
            if _in_flight == 0 or run_time >= LEVELS_END_S + CONFIG["timeout_s"] + 1:
                return None
            users = CONFIG["levels"][-1]  # kept, idle, until their last requests are answered
            return users, max(users, 100)
        users = CONFIG["levels"][int(run_time // CONFIG["level_s"])]
        return users, max(users, 100)


class Client(FastHttpUser):
    network_timeout = CONFIG["timeout_s"]
    connection_timeout = CONFIG["timeout_s"]

    def _post(self, path: str, body: dict, name: str):
        global _in_flight
        if self.environment.shape_class.get_run_time() >= LEVELS_END_S:
            time.sleep(0.2)  # the levels are over: nothing new
            return
        headers = {"Authorization": f"Bearer {next(_tokens)}", "Content-Type": "application/json"}
        _in_flight += 1
        try:
            with self.client.post(path, json=body, headers=headers, name=name, catch_response=True) as response:
                response.success()  # every outcome is recorded; load.py classifies them
                retry_after = _retry_after_s(response) if response.status_code in (429, 503) else None
        finally:
            _in_flight -= 1
        if retry_after and CONFIG["honor_retry_after"]:
            time.sleep(retry_after)  # as the SDKs do; gevent's sleep under locust

    @task
    def one_request(self):
        query = next(_queries)
        if CONFIG["scenario"] == "search":
            self._post("/api/v1/search", {"query": query, "mode": "hybrid", "top_k": 10}, "search")
        else:
            body = {
                "model": CONFIG["model"],
                "messages": [{"role": "user", "content": query}],
                "max_tokens": CONFIG["max_tokens"],
            }
            self._post("/v1/chat/completions", body, "answers")
