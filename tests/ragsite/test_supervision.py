"""The supervisor of ``manage.py up``'s children, with real processes: a child that dies is
restarted with backoff and the reason logged, what it forked dies with it, and one that
keeps dying is given up on with that reason."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from ragsite import supervision
from ragsite.supervision import SupervisedProcess, exit_reason


def supervise_until(process: SupervisedProcess, done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        process.supervise()
        time.sleep(0.01)


def test_exit_reasons():
    assert exit_reason(0) == "exit status 0"
    assert exit_reason(3) == "exit status 3"
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGTERM) == "killed by SIGTERM"


def test_a_child_that_keeps_dying_is_restarted_with_backoff_then_given_up_on(monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_MAX_S", 0.05)  # 1, 2, 4, 8 s, cut short for the test
    lines, notices, deaths = [], [], []
    process = SupervisedProcess(
        "crashy",
        [sys.executable, "-c", "print('starting'); raise SystemExit(3)"],
        dict(os.environ),
        log=lines.append,
        notice=notices.append,
        on_death=lambda: deaths.append(1) or "its tasks went back",
    )
    process.start()
    supervise_until(process, lambda: process.gave_up)

    assert process.gave_up == "crashy died 5 times in 60 s (last: exit status 3)"
    assert process.restarts == 4 and len(deaths) == 5 and lines.count("starting") == 5
    died = [line for line in notices if "restarting in" in line]
    assert [line.split("; ")[1] for line in died] == [
        f"restarting in 0.05 s ({count} of 5 deaths allowed in 60 s)" for count in range(1, 5)
    ]
    assert all(line.startswith("crashy: exit status 3 after ") for line in died)
    assert notices.count("crashy: its tasks went back") == 5
    assert sum(line.startswith("crashy: restarted (pid ") for line in notices) == 4
    assert notices[-1] == "crashy: exit status 3; crashy died 5 times in 60 s (last: exit status 3): not restarting it"
    for _ in range(5):  # given up: never started again
        process.supervise()
    assert process.restarts == 4


def test_a_killed_child_is_restarted_and_what_it_forked_dies_with_it(monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_MAX_S", 0.05)
    notices = []
    # The child forks a grandchild in its process group (as a Celery worker forks its pool).
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); time.sleep(300)"
    lines = []
    process = SupervisedProcess(
        "worker", [sys.executable, "-c", code], dict(os.environ), log=lines.append, notice=notices.append
    )
    try:
        process.start()
        deadline = time.monotonic() + 30
        while not lines:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        grandchild = psutil.Process(int(lines[0]))
        first = process.process.pid
        os.kill(first, signal.SIGKILL)
        supervise_until(process, lambda: process.restarts == 1)
        assert process.process.pid != first and process.alive()
        grandchild.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent
        assert not grandchild.is_running()
        assert notices[0].startswith("worker: killed by SIGKILL after ")
        assert notices[0].endswith("; restarting in 0.05 s (1 of 5 deaths allowed in 60 s)")
        assert notices[1] == f"worker: restarted (pid {process.process.pid})"
    finally:
        process.stop(timeout=5)
    assert not process.alive()


@pytest.mark.parametrize("window", [60.0, 1800.0])
def test_deaths_older_than_the_window_are_forgotten(monkeypatch, window):
    monkeypatch.setattr(supervision, "BACKOFF_MAX_S", 0.01)
    process = SupervisedProcess(
        "old", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), death_window_s=window
    )
    now = time.monotonic()
    process.deaths.extend([now - window - 5] * 4)  # four deaths, all long ago
    process.start()
    supervise_until(process, lambda: process.restarts == 1)
    assert process.gave_up is None and len(process.deaths) == 1  # only the new one counts
    process.stop(timeout=5)
