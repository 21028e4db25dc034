"""launch.supervisor with real child processes (tiny Python one-liners, no services): a child
that exits is restarted with backoff and its same log; one that keeps exiting is given up on,
loudly; a stopped supervisor restarts nothing. The stack itself: tests/integration/test_faults.py.
"""

from __future__ import annotations

import sys
import time

from launch.processes import ServiceProcess
from launch.supervisor import RestartPolicy, Supervisor

FAST = RestartPolicy(
    min_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, window_s=60, poll_s=0.02
)


def child(tmp_path, name: str, code: str) -> ServiceProcess:
    return ServiceProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_killed_child_is_restarted_with_the_same_command_and_log(tmp_path):
    proc = child(tmp_path, "sleeper", "import time; print('up', flush=True); time.sleep(60)")
    supervisor = Supervisor(FAST)
    supervisor.watch(proc)
    supervisor.start()
    try:
        wait_until(lambda: "up" in proc.log_path.read_text())
        first_pid = proc.proc.pid
        proc.proc.kill()
        wait_until(lambda: proc.proc.pid != first_pid and proc.alive())
        wait_until(lambda: proc.log_path.read_text().count("up") == 2)
        assert supervisor.restarts == 1 and not supervisor.failed.is_set()
    finally:
        supervisor.stop()
        proc.stop()


def test_a_child_that_keeps_exiting_is_given_up_on_loudly(tmp_path):
    proc = child(tmp_path, "crasher", "import sys; sys.exit(3)")
    supervisor = Supervisor(FAST)
    supervisor.watch(proc)
    started = time.monotonic()
    supervisor.start()
    try:
        assert supervisor.failed.wait(30)
        assert supervisor.restarts == FAST.max_restarts
        assert "crasher exited 4 times" in supervisor.failure
        assert "exit code 3" in supervisor.failure and str(proc.log_path) in supervisor.failure
        # Backed off between restarts: at least min, 2*min, 4*min (each drawn from [d/2, d]).
        assert time.monotonic() - started >= (0.05 + 0.1 + 0.2) / 2
    finally:
        supervisor.stop()
        proc.stop()


def test_nothing_is_restarted_once_the_supervisor_is_stopped(tmp_path):
    proc = child(tmp_path, "sleeper", "import time; time.sleep(60)")
    supervisor = Supervisor(FAST)
    supervisor.watch(proc)
    supervisor.start()
    supervisor.stop()
    proc.stop()
    time.sleep(0.2)
    assert not proc.alive() and supervisor.restarts == 0
