"""The step-phase profile (``--profile-steps N``): wall time per named phase of each step, per process.

Each process that runs steps (the worker, the scheduler core, each API server, or the offline
``pagewire.LLM``, which runs them all in one) turns it on once at start with ``configure(role,
every_steps)``, marks its phases with ``with phase(name):`` and ends each step with
``end_step(num_tokens)``. Every ``every_steps`` steps it logs ONE line and starts a new window::

    step profile {"role": "worker", "pid": 4242, "steps": 256, "tokens": 65536, "wall_us": 401234.5,
                  "cpu_us": 380012.0, "phases": {"forward": {"total_us": 81234.5, "us_per_step": 317.32,
                  "us_per_token": 1.24}, ...}}

``steps`` and ``tokens`` (the tokens sampled in those steps) are the window's; ``wall_us`` is the
window's wall time, idle time included, and ``cpu_us`` the CPU time the process used in it (every
thread, user and system); each phase has its total, and its mean per step and per token.
``summary()`` gives the same figures summed since the start (or the last ``reset()``), for a caller
in the same process (``LLM.profile()``); ``parse_line`` reads a logged line back.

The times are ``time.perf_counter_ns`` around the code of each phase: host wall time. On CUDA the
worker's phases that launch kernels measure the launches, and the phase that synchronises
(``sample``: the sampled ids to the host) also holds the wait for the GPU. A process that waits
for a core (more busy processes than cores) has that wait in whichever phase it falls in; the
window's ``cpu_us`` against its ``wall_us`` tells how busy the process was. Phases of one name
never overlap (one task runs them); phases of different names may nest, and then both count.

Off (the default, ``every_steps`` 0), ``phase`` returns one shared no-op context manager and
``end_step`` returns at once. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

log = logging.getLogger("pagewire.profile")

LINE_PREFIX = "step profile "
_clock = time.perf_counter_ns
_cpu_clock = time.process_time_ns
_OFF = contextlib.nullcontext()


class _Phase:
    """Adds the wall time of each ``with`` block to its phase in the profile's window."""

    __slots__ = ("name", "profile", "start")

    def __init__(self, profile: StepProfile, name: str):
        self.profile = profile
        self.name = name
        self.start = 0

    def __enter__(self) -> None:
        self.start = _clock()

    def __exit__(self, *exc) -> None:
        window = self.profile.window_ns
        window[self.name] = window.get(self.name, 0) + _clock() - self.start


class StepProfile:
    """The phases of one process's steps: a window logged and restarted every ``every_steps`` steps,
    and the totals of the windows before it."""

    def __init__(self, role: str, every_steps: int):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.role = role
        self.every_steps = every_steps
        self._phases: dict[str, _Phase] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every figure: the window and the totals start now."""
        self.window_ns: dict[str, int] = {}  # phase -> ns in this window
        self.window_steps = 0
        self.window_tokens = 0
        self.window_start_ns = _clock()
        self.window_start_cpu_ns = _cpu_clock()
        self.total_ns: dict[str, int] = {}  # phase -> ns in the windows already logged
        self.total_steps = 0
        self.total_tokens = 0
        self.total_start_ns = self.window_start_ns
        self.total_start_cpu_ns = self.window_start_cpu_ns

    def phase(self, name: str) -> _Phase:
        timer = self._phases.get(name)
        if timer is None:
            timer = self._phases[name] = _Phase(self, name)
        return timer

    def add(self, name: str, ns: int) -> None:
        """Count ``ns`` nanoseconds, measured by the caller, in phase ``name``."""
        self.window_ns[name] = self.window_ns.get(name, 0) + ns

    def end_step(self, num_tokens: int) -> None:
        self.window_steps += 1
        self.window_tokens += num_tokens
        if self.window_steps >= self.every_steps:
            now, cpu_now = _clock(), _cpu_clock()
            log.info("%s%s", LINE_PREFIX, json.dumps(self._figures(
                self.window_ns, self.window_steps, self.window_tokens, now - self.window_start_ns,
                cpu_now - self.window_start_cpu_ns)))
            for name, ns in self.window_ns.items():
                self.total_ns[name] = self.total_ns.get(name, 0) + ns
            self.total_steps += self.window_steps
            self.total_tokens += self.window_tokens
            self.window_ns = {}
            self.window_steps = self.window_tokens = 0
            self.window_start_ns, self.window_start_cpu_ns = now, cpu_now

    def summary(self) -> dict:
        """Every step since the start or the last ``reset()``, logged or not, as a logged line has it."""
        phases = dict(self.total_ns)
        for name, ns in self.window_ns.items():
            phases[name] = phases.get(name, 0) + ns
        return self._figures(phases, self.total_steps + self.window_steps, self.total_tokens + self.window_tokens,
                             _clock() - self.total_start_ns, _cpu_clock() - self.total_start_cpu_ns)

    def _figures(self, phases_ns: dict[str, int], steps: int, tokens: int, wall_ns: int, cpu_ns: int) -> dict:
        return {
            "role": self.role, "pid": os.getpid(), "steps": steps, "tokens": tokens, "wall_us": round(wall_ns / 1e3, 1),
            "cpu_us": round(cpu_ns / 1e3, 1),
            "phases": {name: {"total_us": round(ns / 1e3, 1),
                              "us_per_step": round(ns / 1e3 / steps, 2) if steps else None,
                              "us_per_token": round(ns / 1e3 / tokens, 3) if tokens else None}
                       for name, ns in phases_ns.items()},
        }


_active: StepProfile | None = None


def configure(role: str, every_steps: int) -> StepProfile | None:
    """Profile this process's steps as ``role``, logging every ``every_steps`` steps; 0 turns it off.
    One profile per process: the last call decides."""
    global _active
    _active = StepProfile(role, every_steps) if every_steps else None
    return _active


def active() -> StepProfile | None:
    """This process's profile, or None when it is off."""
    return _active


def phase(name: str):
    """``with phase("schedule"): ...`` adds the block's wall time to the phase; a no-op when off."""
    profile = _active
    return _OFF if profile is None else profile.phase(name)


def end_step(num_tokens: int) -> None:
    """One step ended, in which ``num_tokens`` tokens were sampled."""
    profile = _active
    if profile is not None:
        profile.end_step(num_tokens)


def parse_line(line: str) -> dict | None:
    """The figures of a logged ``step profile`` line (any log prefix before it), else None."""
    at = line.find(LINE_PREFIX)
    if at < 0:
        return None
    try:
        figures = json.loads(line[at + len(LINE_PREFIX):])
    except ValueError:
        return None
    return figures if isinstance(figures, dict) and "phases" in figures else None
