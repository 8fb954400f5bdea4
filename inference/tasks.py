"""Celery tasks of generation: one request, streamed into Redis.

``generate_local`` runs the speculative-decoding engine on queue ``gpu``;
``generate_remote`` calls an OpenAI-compatible upstream on queue ``remote`` (a threads-pool
worker: the call is I/O-bound and must not hold the single GPU process).
"""

from __future__ import annotations

import logging
import time

import redis
import torch
from billiard.exceptions import WorkerLostError
from celery import Task, shared_task
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure

from inference.engine import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.engine.models import models_load
from inference.engine.speculative import GenerationError
from inference.remote import RemoteEndpoint, RemoteRequest, RemoteStats, UpstreamError, stream_chat
from inference.streams import TERMINAL, StreamWriter

logger = logging.getLogger(__name__)

# A generation is acknowledged when it ends, however it ends, and never redelivered: its
# stream may already hold tokens the reader has shown, and running it again would append a
# second answer (and bill it twice). When the process running it dies, the worker's parent
# ends the stream with an error instead (``_end_stream_of_lost_generation``).
GENERATION_TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": False}


def _already_streamed(writer: StreamWriter, expected: int = 0) -> dict | None:
    """Refuse to run a request twice: a message redelivered (after its whole worker vanished,
    past the broker's visibility timeout) finds its stream already started. ``expected``:
    the events a handover found there (``inference.execution``), which are not a restart."""
    events, last = writer.history()
    if events <= expected and last not in TERMINAL:
        return None
    if last in TERMINAL:
        return {"skipped": "already finished"}
    writer.write(
        "error",
        field=None,
        message=(
            f"interrupted: the worker running this request was lost after {events} event"
            f"{'s' if events != 1 else ''}; not restarted, so that no token is sent twice"
        ),
    )
    return {"error": "interrupted"}


def _stream_to(writer: StreamWriter, pieces, stats_type: type) -> dict:
    """Write a backend's text deltas to the stream, then its stats; returns the stats dict."""
    stats = None
    for piece in pieces:
        if isinstance(piece, stats_type):
            stats = piece
        else:
            writer.write("delta", text=piece)
    result = stats.as_dict()
    writer.write("stats", **result)
    return result


@shared_task(name="inference.tasks.generate_local", bind=True, **GENERATION_TASK_OPTIONS)
def generate_local(self, request_id: str, payload: dict) -> dict:
    """Run one generation on this process's device and stream it to ``gen:<request_id>``.

    ``payload``: model, draft_model, dtype (optional, e.g. "float32"), prompt (text) or
    prompt_ids, max_tokens, temperature, top_p, stop, seed, speculative {method, k, adaptive_k}.
    A bad request, an out-of-memory error or a crash inside the model fails this request
    only (an ``error`` event with the reason); the worker goes on serving. A killed process
    fails its request the same way (see ``GENERATION_TASK_OPTIONS``).
    """
    writer = StreamWriter(request_id)
    if (refused := _already_streamed(writer)) is not None:
        return refused
    try:
        models = models_load(payload["model"], payload.get("draft_model"), dtype=payload.get("dtype"))
        prompt_ids = payload.get("prompt_ids") or models.tokenizer.encode(payload["prompt"])
        spec = payload.get("speculative") or {}
        request = GenerationRequest(
            prompt_ids=list(prompt_ids),
            max_tokens=int(payload.get("max_tokens", 256)),
            temperature=float(payload.get("temperature", 0.0)),
            top_p=float(payload.get("top_p", 1.0)),
            stop=tuple(payload.get("stop") or ()),
            seed=payload.get("seed"),
            speculative=SpeculativeConfig(
                method=spec.get("method", "off"), k=int(spec.get("k", 4)), adaptive_k=bool(spec.get("adaptive_k"))
            ),
        )
        pieces = generate(
            request,
            target=models.target,
            tokenizer=models.tokenizer,
            draft=models.draft,
            context_window=models.context_window,
        )
        return _stream_to(writer, pieces, GenerationStats)
    except GenerationError as exc:
        writer.write("error", field=exc.field, message=str(exc))
        return {"error": str(exc)}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        writer.write(
            "error",
            field=None,
            message="the GPU ran out of memory for this request; try fewer max_tokens or a shorter prompt",
        )
        return {"error": "out of memory"}
    except (KeyError, TypeError, ValueError) as exc:
        writer.write("error", field=None, message=f"invalid request: {exc}")
        return {"error": str(exc)}
    except Exception as exc:  # a crash in the model fails this request, not the worker
        logger.exception("generation %s failed", request_id)
        writer.write("error", field=None, message=f"generation failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


class _RedactedArgsTask(Task):
    """Sends ``(request_id, payload)`` with the payload left out of ``argsrepr``, the copy of
    the arguments that Celery puts in message headers, events and log records."""

    def apply_async(self, args=None, kwargs=None, **options):
        if args and "argsrepr" not in options:
            options["argsrepr"] = repr((args[0], "<payload withheld>", *args[2:]))
        return super().apply_async(args, kwargs, **options)


def _remote_field(payload: dict, name: str, convert, default=None):
    value = payload.get(name, default)
    if value is None:
        return None
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise GenerationError(name, f"must be {convert.__name__}, got {value!r}") from None


@shared_task(name="inference.tasks.generate_remote", bind=True, base=_RedactedArgsTask, **GENERATION_TASK_OPTIONS)
def generate_remote(self, request_id: str, payload: dict) -> dict:
    """Run one generation on an OpenAI-compatible upstream and stream it to ``gen:<request_id>``.

    ``payload``: base_url, api_key, model, messages (or prompt, sent as one user message),
    max_tokens, temperature, top_p, stop, seed, speculative {method, k, draft_model,
    ngram_max, ngram_min}, connect_timeout_s, first_token_timeout_s, total_timeout_s,
    extra_body. One attempt, no retries: the router owns those.

    Events: ``delta`` {text}..., then ``stats`` (``RemoteStats.as_dict()``) or ``error``:
    {field, message} for a request refused before any call, {field: null, kind, status,
    retry_after_s, tokens_sent, retryable, message} for an upstream failure.

    The key travels in the payload because upstream key storage does not exist yet; the
    router will pass a key id instead and resolve it here. Until then the payload is never
    logged, returned or put in ``argsrepr`` (see ``_RedactedArgsTask``), and error messages
    never contain the key.
    """
    writer = StreamWriter(request_id)
    if (refused := _already_streamed(writer)) is not None:
        return refused
    try:
        messages = payload.get("messages")
        if messages is None and payload.get("prompt") is not None:
            messages = [{"role": "user", "content": str(payload["prompt"])}]
        endpoint = RemoteEndpoint(
            base_url=str(payload.get("base_url") or ""),
            api_key=str(payload.get("api_key") or ""),
            model=str(payload.get("model") or ""),
            connect_timeout_s=_remote_field(payload, "connect_timeout_s", float, 5),
            first_token_timeout_s=_remote_field(payload, "first_token_timeout_s", float, 30),
            total_timeout_s=_remote_field(payload, "total_timeout_s", float, 300),
            extra_body=payload.get("extra_body"),
        )
        request = RemoteRequest(
            messages=messages,
            max_tokens=_remote_field(payload, "max_tokens", int, 256),
            temperature=_remote_field(payload, "temperature", float, 0.0),
            top_p=_remote_field(payload, "top_p", float, 1.0),
            stop=(payload["stop"],) if isinstance(payload.get("stop"), str) else tuple(payload.get("stop") or ()),
            seed=_remote_field(payload, "seed", int),
            speculative=payload.get("speculative"),
        )
        return _stream_to(writer, stream_chat(endpoint, request), RemoteStats)
    except GenerationError as exc:
        writer.write("error", field=exc.field, message=str(exc))
        return {"error": str(exc)}
    except UpstreamError as exc:
        writer.write("error", field=None, **exc.as_dict())
        return {"error": exc.kind, "status": exc.status, "tokens_sent": exc.tokens_sent}
    except Exception as exc:  # a bug fails this request, not the worker; the payload is not logged
        logger.exception("remote generation %s failed", request_id)
        writer.write("error", field=None, kind=None, message=f"generation failed: {type(exc).__name__}")
        return {"error": type(exc).__name__}


@shared_task(name="inference.tasks.generate_routed", bind=True, base=_RedactedArgsTask, **GENERATION_TASK_OPTIONS)
def generate_routed(self, request_id: str, payload: dict) -> dict:
    """A generation on a route (``inference.router.submit``): keys, retries and failover,
    the stream ``gen:<request_id>``, one ledger row. Sent to queue ``gpu`` for the local
    pool and ``remote`` for an upstream; returns ``Outcome.result`` (text, stats, error,
    route, provider, arm, attempts), which ``submit``'s ``link`` receives.

    When the request must go on on the other queue (a fallback route on the local pool,
    reached from the remote worker, or the reverse), this task is replaced by one on that
    queue with the same id, the attempt state in its payload, and the same ``link``."""
    from inference.execution import run_routed

    writer = StreamWriter(request_id)
    handover = payload.get("handover") or {}
    expected = int(handover.get("events", 0))
    events, last = writer.history()
    if events > expected and last not in TERMINAL:
        # Redelivered after its whole worker vanished (kill -9 of the process group, a lost
        # host) mid-stream: end the stream and queue the ledger row together, as the parent
        # of a dead pool process does, instead of streaming a second answer.
        return _interrupted_routed_end(request_id, payload, events)
    if (refused := _already_streamed(writer, expected=expected)) is not None:
        return refused
    try:
        result = run_routed(request_id, payload)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return _end_after_redis_outage(request_id, payload, exc)
    if result.get("status") == "handed_over":
        return self.replace(generate_routed.signature((request_id, result["payload"]), queue=result["queue"]))
    _ledger_drain_after(request_id)
    return result


# How long a generation that lost Redis mid-stream waits for it to come back, to end its
# stream and queue its ledger row (then its answer is stored by the task's link).
REDIS_OUTAGE_WAIT_S = 120.0


def _end_after_redis_outage(request_id: str, payload: dict, exc: Exception) -> dict:
    """Redis (the stream, the ledger's outbox) went away during the generation: wait for it,
    bounded, then end the stream with an error and queue the ledger row (the tokens the
    stream kept), so that the answer fails with a reason instead of staying ``generating``.
    Re-raises when Redis does not come back in time."""
    from inference.execution import lost_generation_end
    from inference.streams import redis_client

    logger.warning("generation %s lost Redis (%s); waiting for it to end the request", request_id, exc)
    deadline = time.monotonic() + REDIS_OUTAGE_WAIT_S
    while True:
        try:
            redis_client().ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise exc from None
            time.sleep(1.0)
    reason = f"Redis, which holds the answer's stream, was unreachable during the generation ({type(exc).__name__})"
    lost_generation_end(request_id, payload, reason)
    _ledger_drain_after(request_id)
    return {"error": "redis_unreachable"}


def _interrupted_routed_end(request_id: str, payload: dict, events: int) -> dict:
    from inference.execution import lost_generation_end

    reason = (
        f"interrupted: the worker running this request was lost after {events} event"
        f"{'s' if events != 1 else ''} and the message came back to another worker"
    )
    lost_generation_end(request_id, payload, reason)
    _ledger_drain_after(request_id)
    return {"error": "interrupted"}


def _ledger_drain_after(request_id: str) -> None:
    """Store the ledger rows queued so far (this request's, usually alone; one batch at
    most, so that a backlog never holds this task up for long), now that its reader has the
    answer; before the task's ``link`` runs, so that what follows the answer finds the row.
    A failure leaves the rows queued for the beat's drain."""
    from billing import ledger

    try:
        ledger.drain(max_batches=1)
    except Exception:
        logger.exception("ledger rows could not be stored after request %s; the beat's drain retries", request_id)


@task_failure.connect
def _end_stream_of_lost_generation(sender=None, task_id=None, exception=None, args=None, **_):
    """Runs in the worker's parent when a pool process died mid-generation (killed, out of
    host memory, a crash in native code) or hit the hard time limit: the request's stream
    gets its terminal ``error`` so that its reader stops waiting, nothing is retried, and a
    routed request still gets its ledger row (the tokens its stream holds), so that nothing
    served goes unbilled. (``submit``'s ``link_error`` tells the caller, e.g. the answer.)"""
    name = getattr(sender, "name", None)  # shared_task gives proxies: compare by name
    if name not in (generate_local.name, generate_remote.name, generate_routed.name) or not args:
        return
    if isinstance(exception, WorkerLostError):
        reason = f"the worker process running this request died ({exception})"
    elif isinstance(exception, TimeLimitExceeded):
        reason = f"the request ran past the worker's hard time limit ({exception})"
    else:
        return
    if name == generate_routed.name and len(args) > 1:
        # The terminal event and the ledger row (the tokens its stream holds) together.
        from billing import ledger
        from inference.execution import lost_generation_end

        try:
            lost_generation_end(args[0], args[1], reason)
            ledger.drain()
            return
        except Exception:  # the stream must still end; the row's failure is logged, not raised
            logger.exception("the ledger row of lost generation %s could not be queued or stored", args[0])
    writer = StreamWriter(args[0])
    if writer.history()[1] not in TERMINAL:
        writer.write("error", field=None, kind="worker_lost", message=f"{reason}; the request was not retried")


@shared_task(name="inference.tasks.canary_analyse", ignore_result=True)
def canary_analyse() -> list[dict]:
    """Beat, every minute (queue ``default``): judge each live canary release's newest
    complete window, rolling back or promoting a step (``inference.canary.analyse_releases``).
    Safe to run twice at once: each release is analysed under its row lock, once per window."""
    from inference.canary import analyse_releases

    return analyse_releases()
