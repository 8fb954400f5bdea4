"""A malformed setting stops start-up with a message that names the variable."""

import os
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT


def run_manage(*args: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_overrides)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("DEBUG", "maybe", "DEBUG must be a boolean (true/false, 1/0, yes/no, on/off), got 'maybe'"),
        (
            "DATABASE_URL",
            "mysql://u:secret@h/db",
            "DATABASE_URL must be a URL starting with postgres:// or "
            "postgresql:// or pgsql://, got 'mysql://u:***@h/db'",
        ),
        (
            "REDIS_URL",
            "http://localhost:6379",
            "REDIS_URL must be a URL starting with redis:// or rediss:// or unix://, got 'http://localhost:6379'",
        ),
        ("CELERY_TASK_SOFT_TIME_LIMIT", "ten", "CELERY_TASK_SOFT_TIME_LIMIT must be an integer, got 'ten'"),
        ("ALLOWED_HOSTS", "a,,b", "ALLOWED_HOSTS must be a comma-separated list without empty items, got 'a,,b'"),
    ],
)
def test_malformed_setting_fails_startup_with_a_clear_message(variable, value, message):
    result = run_manage("check", **{variable: value})
    assert result.returncode == 1
    assert f"django.core.exceptions.ImproperlyConfigured: {message}" in result.stderr
    assert "secret" not in result.stderr


def test_hard_time_limit_must_exceed_soft_limit():
    result = run_manage("check", CELERY_TASK_SOFT_TIME_LIMIT="100", CELERY_TASK_TIME_LIMIT="50")
    assert result.returncode == 1
    assert "CELERY_TASK_TIME_LIMIT must be greater than CELERY_TASK_SOFT_TIME_LIMIT (got 50 <= 100)" in result.stderr


def test_short_secret_key_is_refused_in_production():
    result = run_manage("check", SECRET_KEY="short", DEBUG="false")
    assert result.returncode == 1
    assert "SECRET_KEY must be at least 32 characters when DEBUG is off" in result.stderr


def test_well_formed_settings_pass_the_system_check():
    result = run_manage("check")
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout
