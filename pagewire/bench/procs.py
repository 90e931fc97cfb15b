"""CPU time of processes, from /proc (Linux; zeros and empty lists elsewhere): what a benchmark
reads to say where a run's CPU went, process by process."""

from __future__ import annotations

import os

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


def serve_roles(serve_pid: int) -> dict[str, list[int]]:
    """Role -> pids of a running `pagewire serve`: the serve supervisor, the worker, the core, each
    API server (its helper processes, tokenizer and multiprocessing's tracker, counted with it)."""
    roles: dict[str, list[int]] = {"serve": [serve_pid]}
    for child in child_pids(serve_pid):
        argv = cmdline(child)
        if " worker " in argv:
            roles["worker"] = [child]
        elif " scheduler " in argv:
            roles["core"] = [child]
            for i, api in enumerate(child_pids(child), 1):
                roles[f"api-server {i}"] = [api, *child_pids(api)]
    return roles


def cpu_by_role(roles: dict[str, list[int]], waited_children: bool = False) -> dict[str, float]:
    return {role: sum(cpu_seconds(p, waited_children) for p in pids) for role, pids in roles.items()}


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
