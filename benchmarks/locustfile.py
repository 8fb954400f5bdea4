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
``level_s`` seconds, then adds users up to the next one, then stops the run. Every request is
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


class StepLevels(LoadTestShape):
    def tick(self):
        step = int(self.get_run_time() // CONFIG["level_s"])
        if step >= len(CONFIG["levels"]):
            return None
        users = CONFIG["levels"][step]
        return users, max(users, 100)


class Client(FastHttpUser):
    network_timeout = CONFIG["timeout_s"]
    connection_timeout = CONFIG["timeout_s"]

    def _post(self, path: str, body: dict, name: str):
        headers = {"Authorization": f"Bearer {next(_tokens)}", "Content-Type": "application/json"}
        with self.client.post(path, json=body, headers=headers, name=name, catch_response=True) as response:
            response.success()  # every outcome is recorded; load.py classifies them
            retry_after = response.headers.get("Retry-After") if response.status_code in (429, 503) else None
        if retry_after and CONFIG["honor_retry_after"]:
            time.sleep(float(retry_after))  # as the SDKs do; gevent's sleep under locust

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
