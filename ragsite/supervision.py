"""Child processes kept running by a supervisor (``manage.py up``, the GPU pool's engine
servers): each in a session of its own, its output relayed line by line, restarted with
backoff when it dies, and given up on when it keeps dying. docs/operations.md says what
``up`` does with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable

# A process that dies this many times within its window is given up on.
MAX_DEATHS = 5
DEATH_WINDOW_S = 60.0
# The wait before a restart doubles with each recent death (1, 2, 4, 8 s), at most this.
BACKOFF_MAX_S = 30.0


def exit_reason(code: int) -> str:
    """How a process ended, as ``Popen.returncode`` tells it."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class SupervisedProcess:
    """One child process, started again when it dies (``supervise``, called in a loop).

    ``log`` receives each line the process prints; ``notice`` the supervisor's own lines
    (by default ``log``). ``on_death`` runs when it is found dead, before anything else, and
    may return a line to log. ``gave_up`` holds the reason once the process died
    ``MAX_DEATHS`` times within ``death_window_s``: it is then not started again.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        log: Callable[[str], None] | None = None,
        notice: Callable[[str], None] | None = None,
        on_death: Callable[[], str | None] | None = None,
        death_window_s: float = DEATH_WINDOW_S,
    ):
        self.name, self.argv, self.env = name, argv, env
        self.log = log or (lambda line: None)
        self._notice = notice
        self._on_death = on_death
        self.death_window_s = death_window_s
        self.process: subprocess.Popen | None = None
        self.tail: deque[str] = deque(maxlen=60)
        self.restarts = 0
        self.deaths: deque[float] = deque()
        self.gave_up: str | None = None
        self._started_at = 0.0
        self._restart_at: float | None = None
        self._stopping = threading.Event()
        self._relay_thread: threading.Thread | None = None

    def notice(self, line: str) -> None:
        (self._notice or self.log)(line)

    def start(self) -> None:
        # A session of its own: Ctrl-C reaches only the supervisor, which stops children in
        # order, and a signal to the group reaches the processes the child forked.
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self._started_at = time.monotonic()
        self._relay_thread = threading.Thread(target=self._relay, args=(self.process,), daemon=True)
        self._relay_thread.start()

    def _relay(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            line = line.rstrip()
            self.tail.append(line)
            self.log(line)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def restarting(self) -> bool:
        return self._restart_at is not None

    def supervise(self) -> None:
        """One look: a process that died is announced, then started again after its backoff."""
        if self._stopping.is_set() or self.process is None or self.gave_up:
            return
        now = time.monotonic()
        if self._restart_at is None:
            code = self.process.poll()
            if code is None:
                return
            self._kill_group()  # what it forked (a Celery pool's processes) goes with it
            if self._on_death is not None:
                try:
                    note = self._on_death()
                except Exception as exc:  # the restart matters more; say what failed
                    note = f"after its death: {type(exc).__name__}: {exc}"
                if note:
                    self.notice(f"{self.name}: {note}")
            self.deaths.append(now)
            while now - self.deaths[0] > self.death_window_s:
                self.deaths.popleft()
            reason = exit_reason(code)
            recent = len(self.deaths)
            if recent >= MAX_DEATHS:
                self.gave_up = f"{self.name} died {recent} times in {self.death_window_s:g} s (last: {reason})"
                self.notice(f"{self.name}: {reason}; {self.gave_up}: not restarting it")
                return
            wait = min(BACKOFF_MAX_S, 2.0 ** (recent - 1))
            self.notice(
                f"{self.name}: {reason} after {now - self._started_at:.0f} s; restarting in {wait:g} s"
                f" ({recent} of {MAX_DEATHS} deaths allowed in {self.death_window_s:g} s)"
            )
            self._restart_at = now + wait
        elif now >= self._restart_at:
            self._restart_at = None
            self.restarts += 1
            self.start()
            self.notice(f"{self.name}: restarted (pid {self.process.pid})")

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: Celery's warm shutdown, uvicorn's graceful one); no restart after."""
        self._stopping.set()
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self._stopping.set()
        if self.process is not None:
            self._kill_group()
            self.process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate, wait up to ``timeout``, then kill its whole process group."""
        self.terminate()
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.notice(f"{self.name} did not stop in {timeout:g} s; killing it")
        self.kill()
        self.output_flush()

    def output_flush(self, timeout: float = 2.0) -> None:
        """Wait until the lines it printed before it ended have reached ``log``."""
        if self._relay_thread is not None:
            self._relay_thread.join(timeout=timeout)
