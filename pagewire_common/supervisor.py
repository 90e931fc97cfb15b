"""Child processes that are kept alive: ``pagewire serve`` (worker, scheduler) and the scheduler
(its API servers) both run their children under a ``Supervisor``.

- A child that dies after it was ready once is started again, after a back-off that doubles
  (0.5 s up to 8 s) and starts over once a child has run for a while.
- A child that dies before it was ever ready (a bad flag, a model that does not load) is not
  retried: the supervisor gives up at once, so the user sees the first error, not five.
- More than ``max_restarts`` restarts of one child within ``window_s`` seconds is a crash loop:
  the supervisor gives up with a message that says which child and how often.
- Children die with their parent: each one asks the kernel for SIGTERM when its parent goes
  (``die_with_parent``, called at the start of every pagewire command), so a hard kill of the
  parent leaves no child behind. Until a service installs its own handler, SIGTERM unwinds the
  child like an exception (``finally`` blocks and ``atexit`` run: no half-written files). The
  parent's temp folder (``run_dir``) is removed by whichever child outlives the parent, so a
  hard kill leaves no folder behind either.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagewire_common import envs

log = logging.getLogger("pagewire.supervisor")

_PR_SET_PDEATHSIG = 1

# the folder the project is imported from (holding pagewire_common/)
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_argv(log_level: str, *args: str) -> list[str]:
    """The command line of a child pagewire process: this interpreter running ``pagewire.cli``. Its
    import path leaves out the current directory (``python -P``), where a user's file named like a
    module (``queue.py``) would shadow the library's, unless the project is imported from there."""
    safe = ["-P"] if os.path.abspath(os.getcwd()) != _PROJECT_ROOT else []
    return [sys.executable, *safe, "-m", "pagewire.cli", "--log-level", log_level, *args]


def die_with_parent(parent: int | None = None, *, unwind: bool = True) -> None:
    """In a child (started by a ``Supervisor``, or ``parent`` given): have the kernel send SIGTERM
    when the parent dies (Linux), exit at once if it already has, let SIGTERM raise SystemExit,
    and remove the parent's temp folder at exit when the parent is gone by then.

    ``unwind=False`` keeps SIGTERM's default instead: the child dies on the spot and runs no
    Python. That suits a helper with nothing to clean up, whose SIGTERM can come while it is
    already exiting (a SystemExit raised inside interpreter shutdown prints a stray traceback).
    The kernel sends the signal when the *thread* that started the child ends, not only the
    process."""
    global _parent_run_dir
    env_parent, run_dir = envs.pop_parent()
    parent = env_parent if parent is None else int(parent)
    if parent is None or not sys.platform.startswith("linux"):
        return
    if run_dir:
        _parent_run_dir = run_dir
        atexit.register(_remove_if_orphaned, run_dir, parent)
    if unwind:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before we got here
        sys.exit(1)


_parent_run_dir: str | None = None


def parent_run_dir() -> str | None:
    """The temp folder of the supervisor that started this process, if it has one: a child that
    puts its own temp folder in it leaves nothing behind when it is killed outright (SIGKILL, the
    OOM killer), as the supervisor removes its folder when it ends."""
    return _parent_run_dir


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _remove_if_orphaned(run_dir: str, parent: int) -> None:
    # the kernel hands an orphan to another parent before it delivers the parent-death signal
    if os.getppid() != parent:
        remove_run_dir(run_dir)


def remove_run_dir(run_dir: str, tries: int = 5) -> None:
    """Remove a temp folder that sibling processes, still starting, may write into meanwhile (an
    API server's first metrics file): a file they add while it is removed leaves the folder, so
    try again, a tenth of a second apart."""
    for attempt in range(tries):
        shutil.rmtree(run_dir, ignore_errors=True)
        if not os.path.exists(run_dir) or attempt == tries - 1:
            return
        time.sleep(0.1)


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready: bool = False  # ready at least once since its first start
    restart_times: deque = field(default_factory=deque)
    backoff: float = 0.5


class Supervisor:
    def __init__(self, *, max_restarts: int = 5, window_s: float = 60.0, stable_s: float = 30.0,
                 on_give_up: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
                 run_dir: str | None = None):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.stable_s = stable_s  # a child that ran this long starts its back-off over
        self.on_give_up = on_give_up or (lambda message: None)
        self.env = env
        self.run_dir = run_dir  # our temp folder: a child that outlives us removes it
        self.children: dict[str, Child] = {}
        self.stopping = False
        self.gave_up: str | None = None
        # what the supervising command exits with once it gave up: 2 when a child refused its
        # command line or settings before it was ready (it said why, as "pagewire: error: ..."), else 1
        self.exit_code = 1
        self.num_restarts = 0

    def start(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv)
        self.children[name] = child
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        env = dict(self.env if self.env is not None else os.environ)
        env[envs.PARENT_PID_ENV] = str(os.getpid())
        if self.run_dir:
            env[envs.PARENT_RUN_DIR_ENV] = self.run_dir
        env.setdefault("PYTHONUNBUFFERED", "1")
        # its own session: a terminal's Ctrl-C reaches it only through us, after we decide
        child.proc = subprocess.Popen(child.argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        child.started_at = time.monotonic()

    def mark_ready(self, name: str) -> None:
        child = self.children.get(name)
        if child is not None:
            child.ready = True

    def pid(self, name: str) -> int | None:
        child = self.children.get(name)
        return child.proc.pid if child and child.proc else None

    async def watch(self, interval: float = 0.1) -> None:
        """Restart children that die, until ``stop`` (or giving up, which calls ``on_give_up``)."""
        while not self.stopping:
            await asyncio.sleep(interval)
            for child in list(self.children.values()):
                if self.stopping or child.proc is None or child.proc.poll() is None:
                    continue
                code = child.proc.returncode
                if not child.ready:
                    self.exit_code = 2 if code == 2 else 1
                    return self._give_up(f"the {child.name} exited with code {code} before it was ready")
                now = time.monotonic()
                if now - child.started_at > self.stable_s:
                    child.backoff = 0.5
                times = child.restart_times
                while times and now - times[0] > self.window_s:
                    times.popleft()
                if len(times) >= self.max_restarts:
                    return self._give_up(
                        f"the {child.name} crashed {len(times) + 1} times within {self.window_s:.0f} s "
                        f"(last exit code {code})")
                times.append(now)
                log.warning("the %s exited with code %s; restarting it in %.1f s", child.name, code, child.backoff)
                child.proc = None
                asyncio.get_running_loop().call_later(child.backoff, self._restart, child)
                child.backoff = min(child.backoff * 2, 8.0)

    def _restart(self, child: Child) -> None:
        if self.stopping or self.children.get(child.name) is not child:
            return
        self._spawn(child)
        self.num_restarts += 1

    def _give_up(self, message: str) -> None:
        self.gave_up = message
        log.error("%s; stopping", message)
        self.on_give_up(message)

    async def stop(self, timeout: float = 10.0, order: list[list[str]] | None = None) -> None:
        """SIGTERM the children: the groups of ``order`` one after the other, each group's children
        at once and awaited together (else all children at once); SIGKILL what is left of a group
        after ``timeout`` seconds."""
        self.stopping = True
        groups = order or [list(self.children)]
        for group in groups:
            procs = [c.proc for n in group if (c := self.children.get(n)) and c.proc is not None]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                while proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if proc.poll() is None:
                    log.warning("a child (pid %d) did not stop within %.0f s; killing it", proc.pid, timeout)
                    proc.kill()
                    proc.wait()
