"""Celery tasks of generation: one routed request, streamed into Redis.

``generate_routed`` runs on queue ``gpu`` for a GPU pool's route and ``remote`` for an
upstream's; both are threads-pool workers holding many calls at once, since each call
waits on an OpenAI-protocol server (a pool device's engine, or the upstream) that does the
decoding. ``inference.execution`` is its body.
"""

from __future__ import annotations

import logging
import time

import redis
from billiard.exceptions import WorkerLostError
from celery import Task, shared_task
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure

from billing.tasks import ledger_drain
from inference import backpressure, pending
from inference.canary import analyse_releases
from inference.execution import lost_generation_end, run_routed
from inference.streams import TERMINAL, StreamWriter
from ragsite.celery import Queue
from ragsite.redis import Role, redis_client

logger = logging.getLogger(__name__)

# A generation is acknowledged when it ends, however it ends, and never redelivered: its
# stream may already hold tokens the reader has shown, and running it again would append a
# second answer (and bill it twice). When the process running it dies, the worker's parent
# ends the stream with an error instead (``_end_stream_of_lost_generation``).
#
# Its outcome travels in its ledger entry (``billing.ledger``), never through the result
# backend: storing it there would keep the answer's text in Redis for result_expires, and cost
# a round trip when the task starts (STARTED), another when it ends and a subscription per call.
GENERATION_TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": False, "ignore_result": True}


class _RedactedArgsTask(Task):
    """Sends ``(request_id, payload)`` with the payload left out of ``argsrepr``, the copy of
    the arguments that Celery puts in message headers, events and log records."""

    def apply_async(self, args=None, kwargs=None, **options):
        if args and "argsrepr" not in options:
            options["argsrepr"] = repr((args[0], "<payload withheld>", *args[2:]))
        return super().apply_async(args, kwargs, **options)


@shared_task(
    name="inference.tasks.generate_routed",
    bind=True,
    base=_RedactedArgsTask,
    **GENERATION_TASK_OPTIONS,
)
def generate_routed(self, request_id: str, payload: dict) -> dict:
    """A generation on a route (``inference.router.submit``): keys, retries and failover,
    the stream ``gen:<request_id>``, one ledger entry (the row, and the outcome for
    ``payload["outcome_to"]``). Sent to queue ``gpu`` for the local pool and ``remote`` for
    an upstream; returns ``Outcome.result``, what the entry carries (text, stats, error,
    route, provider, arm, attempts), or ``{"skipped"}``/``{"error"}`` for a message that
    came back: no result is stored (``ignore_result``), and the worker's log line withholds
    it (``ragsite.logs``).

    When the request must go on on the other queue (a fallback route on the local pool,
    reached from the remote worker, or the reverse), this task is replaced by one on that
    queue with the same id and the attempt state in its payload."""
    queue = (self.request.delivery_info or {}).get("routing_key")
    if queue:
        _taken(queue)
    writer = StreamWriter(request_id)
    handover = payload.get("handover") or {}
    expected = int(handover.get("events", 0))
    # A message redelivered (after its whole worker vanished: kill -9, a lost host, past the
    # broker's visibility timeout) finds its stream already started. It is never run twice:
    # the stream may hold tokens a reader has shown, and a second answer would be billed twice.
    # kombu marks every message it restores ``redelivered``; a first delivery (every request
    # but those) and a handover, whose stream this task continues, are the only others, so
    # only these two look (a round trip on every request's time to first token otherwise).
    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    # A message queued again as lost (inference/pending.py) and found after all: the first
    # delivery to start runs, any other first delivery stops here.
    if payload.get("pending") and not _first_start(request_id) and not (redelivered or handover):
        return {"skipped": "another delivery of this generation started first"}
    events, last = writer.history() if redelivered or handover else (0, None)
    if last in TERMINAL:
        return {"skipped": "already finished"}
    if events > expected:  # ``expected``: the events a handover found there, not a restart
        # Mid-stream: end the stream and queue the ledger row together, as the parent of a
        # dead pool process does.
        return _interrupted_routed_end(request_id, payload, events)
    try:
        result = run_routed(request_id, payload)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return _end_after_redis_outage(request_id, payload, exc)
    if result.get("status") == "handed_over":
        return self.replace(generate_routed.signature((request_id, result["payload"]), queue=result["queue"]))
    _ledger_drain_soon(request_id)
    return result


def _first_start(request_id: str) -> bool:
    try:
        return pending.started(request_id)
    except redis.RedisError as exc:  # the queues' Redis is down: this delivery runs
        logger.warning("generation %s started without its pending record checked (%s)", request_id, exc)
        return True


@shared_task(name="inference.tasks.generations_lost_requeue", ignore_result=True)
def generations_lost_requeue() -> int:
    """Publish again the generations whose message was lost before a worker recorded it
    (inference/pending.py); beat runs it every 10 s. Returns how many."""
    requeued = 0
    for request_id, queue, payload in pending.lost([Queue.GPU.value, Queue.REMOTE.value]):
        logger.warning("generation %s: its message was lost before a worker started it; queued again", request_id)
        generate_routed.apply_async((request_id, payload), queue=queue, task_id=request_id)
        pending.requeued(request_id)
        requeued += 1
    return requeued


def _taken(queue: str) -> None:
    """The queue's drain rate counts this generation (its bound and a refusal's wait read it:
    ``inference.backpressure``); a count lost to a Redis outage only makes the bound smaller."""
    try:
        backpressure.generation_taken(queue)
    except redis.RedisError as exc:
        logger.warning("the drain rate of queue %s missed a generation (%s)", queue, exc)


# How long a generation that lost Redis mid-stream waits for it to come back, to end its
# stream and queue its ledger entry (then the drain stores its answer).
REDIS_OUTAGE_WAIT_S = 120.0


def _end_after_redis_outage(request_id: str, payload: dict, exc: Exception) -> dict:
    """Redis (the stream, the ledger's outbox) went away during the generation: wait for it,
    bounded, then end the stream with an error and queue the ledger row (the tokens the
    stream kept), so that the answer fails with a reason instead of staying ``generating``.
    Re-raises when Redis does not come back in time."""
    logger.warning("generation %s lost Redis (%s); waiting for it to end the request", request_id, exc)
    deadline = time.monotonic() + REDIS_OUTAGE_WAIT_S
    while True:
        try:
            for role in (Role.STREAMS, Role.BROKER):
                redis_client(role).ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise exc from None
            time.sleep(1.0)
    reason = f"Redis, which holds the answer's stream, was unreachable during the generation ({type(exc).__name__})"
    lost_generation_end(request_id, payload, reason)
    _ledger_drain_soon(request_id)
    return {"error": "redis_unreachable"}


def _interrupted_routed_end(request_id: str, payload: dict, events: int) -> dict:

    reason = (
        f"interrupted: the worker running this request was lost after {events} event"
        f"{'s' if events != 1 else ''} and the message came back to another worker"
    )
    lost_generation_end(request_id, payload, reason)
    _ledger_drain_soon(request_id)
    return {"error": "interrupted"}


def _ledger_drain_soon(request_id: str) -> None:
    """Send the drain (``billing.tasks.ledger_drain``, queue ``default``) that stores this
    request's ledger row and hands its outcome to whoever waits (the answer is finalized
    there, off this worker: verifying citations embeds, and a remote worker loads no model).
    A failure to send leaves the entry queued for the beat's drain, within 15 s."""
    try:
        ledger_drain.delay()  # billing.tasks.* go to queue default (ragsite.celery.TASK_ROUTES)
    except Exception:
        logger.exception("the drain after request %s was not sent; the beat's drain takes its entry", request_id)


@task_failure.connect
def _end_stream_of_lost_generation(sender=None, task_id=None, exception=None, args=None, **_):
    """Runs in the worker's parent when a pool process died mid-generation (killed, out of
    host memory, a crash in native code) or hit the hard time limit: the request's stream
    gets its terminal ``error`` so that its reader stops waiting, nothing is retried, and a
    routed request still gets its ledger row (the tokens its stream holds), so that nothing
    served goes unbilled, and its outcome, so that the answer waiting for it fails at once."""
    name = getattr(sender, "name", None)  # shared_task gives proxies: compare by name
    if name != generate_routed.name or not args:
        return
    if isinstance(exception, WorkerLostError):
        reason = f"the worker process running this request died ({exception})"
    elif isinstance(exception, TimeLimitExceeded):
        reason = f"the request ran past the worker's hard time limit ({exception})"
    else:
        return
    if len(args) > 1:
        # The terminal event, the ledger row (the tokens its stream holds) and the outcome together.
        try:
            lost_generation_end(args[0], args[1], reason)
            _ledger_drain_soon(args[0])
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
    return analyse_releases()
