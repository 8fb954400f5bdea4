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

SERVICES = {"db", "redis", "migrate", "web", "worker", "gpu-worker", "remote-worker", "beat"}
APP_SERVICES = {"migrate", "web", "worker", "gpu-worker", "remote-worker", "beat"}
CELERY_WORKERS = {"worker", "gpu-worker", "remote-worker"}
LONG_RUNNING_APP_SERVICES = APP_SERVICES - {"migrate"}

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
    assert services["migrate"]["restart"] == "no"


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


def test_gpu_worker_runs_one_process_taking_one_message_at_a_time(services):
    args = argv(services["gpu-worker"]["command"])
    assert single_option(args, "-c", "--concurrency") == "1"
    assert single_option(args, "--prefetch-multiplier") == "1"


def test_gpu_worker_reserves_an_nvidia_gpu(services):
    devices = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    nvidia = [device for device in devices if device.get("driver") == "nvidia"]
    assert len(nvidia) == 1, devices
    assert "gpu" in nvidia[0]["capabilities"]
    count = nvidia[0].get("count")
    assert count == "all" or (isinstance(count, int) and count >= 1) or nvidia[0].get("device_ids"), nvidia


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
    for name in ("web", "worker", "gpu-worker", "remote-worker"):
        healthcheck_command(services[name])


def test_services_start_after_what_they_need(services):
    after_migrate = {
        "db": "service_healthy",
        "redis": "service_healthy",
        "migrate": "service_completed_successfully",
    }
    for name in LONG_RUNNING_APP_SERVICES:
        depends_on = services[name]["depends_on"]
        assert {dep: spec["condition"] for dep, spec in depends_on.items()} == after_migrate, name
    migrate_deps = services["migrate"]["depends_on"]
    assert migrate_deps["db"]["condition"] == "service_healthy"


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
