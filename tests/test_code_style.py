"""The tree stays ruff-clean (lint and format), so style never drifts between sessions."""

import subprocess
import sys

from tests.conftest import PROJECT_ROOT


def test_ruff_lint_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_missing_migrations():
    result = subprocess.run(
        [sys.executable, "manage.py", "makemigrations", "--check", "--dry-run"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
