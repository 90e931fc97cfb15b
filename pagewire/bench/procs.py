"""CPU time of processes, from /proc (Linux; zeros and empty lists elsewhere): what a benchmark
reads to say where a run's CPU went, process by process."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pagewire.bench.server import child_pids, descendant_pids


def cpu_seconds(pid: int, waited_children: bool = False) -> float:
    """User + system CPU time of ``pid`` (all its threads), and with ``waited_children`` that of the
    children it has waited for; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15 if waited_children else 13]) / os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU time this machine has spent busy since boot, all cores (/proc/stat; steal counts as busy:
    the hypervisor gave the core to someone else)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_RANK = re.compile(r" --rank (\d+)")


def serve_roles(serve_pid: int) -> dict[str, list[int]]:
    """Role -> pids of a running `pagewire serve`: "serve" (the supervisor), "worker" (rank 0),
    "worker rank R" (each further tensor-parallel rank, which rank 0 starts), "core", each
    "api-server N" (the core's children, by pid) and "api-server N helpers" (its tokenizer helper
    and multiprocessing's resource tracker) where it has started any. With --data-parallel-size the
    workers pool in "worker", the engine cores in "core", and the API servers are serve's children. A process none of these
    names (a compile worker, say) counts with the nearest ancestor that has a role; every process
    of the tree is in exactly one role."""
    roles: dict[str, list[int]] = {}

    def add(pid: int, role: str) -> None:
        roles.setdefault(role, []).append(pid)
        api_servers = 0
        for child in sorted(child_pids(pid)):
            argv = cmdline(child)
            rank = _RANK.search(argv)
            if role == "serve" and " worker " in argv:
                add(child, "worker")
            elif role == "serve" and " scheduler " in argv:
                add(child, "core")
            elif role == "worker" and rank:
                add(child, f"worker rank {rank.group(1)}")
            elif role in ("core", "serve") and " api-server " in argv:
                api_servers += 1
                add(child, f"api-server {api_servers}")
            elif role.startswith("api-server") and not role.endswith(" helpers"):
                add(child, f"{role} helpers")
            else:
                add(child, role)

    add(serve_pid, "serve")
    return roles


def cpu_by_role(roles: dict[str, list[int]], waited_children: bool = False) -> dict[str, float]:
    return {role: sum(cpu_seconds(p, waited_children) for p in pids) for role, pids in roles.items()}


@dataclass(frozen=True, slots=True)
class RoleCpu:
    """The CPU one role (a process or a few, see ``serve_roles``) spent over a run, or over runs pooled."""

    cpu_s: float  # user + system seconds
    us_per_token: float | None  # cpu_s per completion token, in µs; None over no token
    busy_fraction: float  # cpu_s / the run's wall time: 1.0 is one core busy all along

    @classmethod
    def of(cls, cpu_s: float, completion_tokens: int, duration_s: float) -> RoleCpu:
        return cls(
            cpu_s=cpu_s,
            us_per_token=cpu_s * 1e6 / completion_tokens if completion_tokens else None,
            busy_fraction=cpu_s / duration_s if duration_s > 0 else 0.0,
        )

    def to_dict(self) -> dict:
        return {"cpu_s": self.cpu_s, "us_per_token": self.us_per_token, "busy_fraction": self.busy_fraction}


class RunCpu:
    """Where the CPU went while a run went on: each process of the server under test and this one
    (the client), in seconds, and what processes other than these took (on a shared machine, what
    the figures lost to others)."""

    def __init__(self, server_pid: int, roles: dict[str, list[int]]):
        self.server_pid = server_pid
        self.roles = {**roles, "client": [os.getpid()]}

    def _ours(self) -> float:
        return sum(cpu_seconds(p) for p in [os.getpid(), self.server_pid, *descendant_pids(self.server_pid)])

    def start(self) -> None:
        self.busy0, self.ours0, self.by_role0 = busy_cpu_seconds(), self._ours(), cpu_by_role(self.roles)

    def stop(self) -> tuple[float, dict[str, float]]:
        """(CPU seconds other processes took, CPU seconds by role)."""
        others = max(0.0, busy_cpu_seconds() - self.busy0 - (self._ours() - self.ours0))
        by_role = {role: cpu - self.by_role0[role] for role, cpu in cpu_by_role(self.roles).items()}
        return others, by_role
