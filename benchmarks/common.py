"""Shared helpers: Django set-up, machine description, result files."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CRANFIELD = ROOT.parent / "shared" / "data" / "cranfield"


def django_setup() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
    import django

    django.setup()


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def report(name: str, result: dict) -> None:
    """Write benchmarks/results/NAME.json and print the final JSON line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **result, "machine": machine()}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload), flush=True)
