"""Starting, joining and running the ranks of a tensor-parallel worker.

- ``start_runner(model_dir, settings)`` is what rank 0 (``pagewire worker``, ``pagewire.LLM``)
  calls: with one rank, a plain ``ModelRunner``; with N, it starts ranks 1..N-1 on this machine
  (unless ``--rank 0`` says they are started elsewhere), joins the group and returns a
  ``DriverRunner``, which hands every plan to the other ranks before running its own shard.
- ``run_rank(model_dir, settings)`` is a rank other than 0 (``pagewire worker --rank R``): it
  joins, loads its shard and runs every plan rank 0 hands it until rank 0 stops.

The ranks meet at a TCP store served by rank 0 (``--distributed-init``, else a free loopback
port). Math collectives (all-reduce, the logits gather) run on the default group, gloo on CPU
and NCCL on CUDA, with ``STEP_TIMEOUT``; the plan hand-off on a gloo group of its own that waits
without a practical deadline (an idle worker sends nothing). A rank that dies takes the group
down: its peers' collectives fail at once (the connection closes), rank 0 stops the worker, and
ranks started here die with rank 0 (``die_with_parent``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from pagewire_common import wire
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.settings import WORKER, Settings
from pagewire_common.supervisor import cli_argv
from pagewire_common.envs import PARENT_PID_ENV
from worker_svc.parallel.group import GroupFailed, TensorParallel
from worker_svc.parallel.handoff import Kind, PlanChannel

log = logging.getLogger("pagewire.worker")

JOIN_TIMEOUT = timedelta(minutes=10)  # for every rank to reach the store, and to load its shard
STEP_TIMEOUT = timedelta(minutes=10)  # for a peer to enter the same collective
IDLE_TIMEOUT = timedelta(days=365)  # for rank 0's next plan


def _runner_config(settings: Settings, rank: int):
    import dataclasses

    import torch

    from worker_svc.runner import RunnerConfig

    config = RunnerConfig.from_settings(settings)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" or device.startswith("cuda:"):  # one GPU per rank, from the one named (cuda:K: K, K+1, ...)
        first = int(device.partition(":")[2] or 0)
        device = f"cuda:{(first + rank) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    return dataclasses.replace(config, device=device)


def _set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


def _join(rank: int, world_size: int, store, device: str) -> tuple[TensorParallel, PlanChannel]:
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, world_size, dist.group.WORLD), PlanChannel(control)


def _store_address(settings: Settings) -> tuple[str, int]:
    host, _, port = str(settings.distributed_init).removeprefix("tcp://").rpartition(":")
    return host, int(port)


# ---- rank 0 -------------------------------------------------------------------------------------


def local_threads(settings: Settings) -> int:
    """Ranks on one machine share its cores: each takes its part unless --num-threads says."""
    return settings.num_threads or max(1, (os.cpu_count() or 1) // settings.num_ranks)


class LocalRanks:
    """Ranks 1..N-1 as child processes of rank 0 (``pagewire worker --rank R``), which die with it."""

    def __init__(self, settings: Settings, store_host: str, store_port: int):
        n = settings.num_ranks
        child = settings.replace(tensor_parallel_size=n, rank=None, world_size=None, distributed_init=None,
                                 num_threads=local_threads(settings))
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, n):
            argv = cli_argv(level, "worker", "--rank", str(rank), "--world-size", str(n),
                            "--distributed-init", f"{store_host}:{store_port}", *child.to_argv((WORKER,)))
            # a session of their own: a terminal's Ctrl-C reaches them through rank 0's STOP only
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True))

    def lost(self) -> str | None:
        """Which rank exited, if one did."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
        return None

    def wait_joined(self, store, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        keys = [f"joined/{rank}" for rank in range(1, len(self.procs) + 1)]
        while not store.check(keys):
            lost = self.lost()
            if lost:
                raise RuntimeError(f"{lost} before joining the group")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tensor-parallel ranks did not join within {timeout}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0, told: bool = False) -> None:
        """Wait for ranks that were ``told`` to stop, then SIGTERM (and after ``timeout``, SIGKILL)
        what is left."""
        deadline = time.monotonic() + timeout
        for signal_them in ((lambda proc: None) if told else (lambda proc: proc.terminate()), lambda proc: proc.kill()):
            for proc in self.procs:
                if proc.poll() is None:
                    signal_them(proc)
            for proc in self.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + timeout


class DriverRunner:
    """Rank 0's runner: hands each plan (with the ids it sampled in the previous step) to the other
    ranks, then runs its own shard and returns the step's result. Everything else is its
    ``ModelRunner``'s (``model_config``, ``num_kv_blocks``, ...)."""

    def __init__(self, runner, channel: PlanChannel, local_ranks: LocalRanks | None):
        self.runner = runner
        self.channel = channel
        self.local_ranks = local_ranks
        self._sampled: list[int] = []  # rank 0's ids of the last step, for the other ranks
        self.closed = False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan: StepPlan) -> StepResult:
        payload = wire.plan_to_pb(plan).SerializeToString()
        sampled, self._sampled = self._sampled, []
        try:
            self.channel.send(Kind.PLAN, sampled, payload)
            # a plan that contradicts the state raises KeyError/ValueError here and on every rank alike
            result = self.runner.execute(plan)
        except RuntimeError as e:  # a collective failed: a rank is gone
            raise self._failed(e) from e
        self._sampled = result.token_ids
        return result

    def reset(self) -> None:
        self._sampled = []
        try:
            self.channel.send(Kind.RESET)
        except RuntimeError as e:
            raise self._failed(e) from e
        self.runner.reset()

    def _failed(self, error: RuntimeError) -> GroupFailed:
        """Which rank is gone: a dead rank's connections close before its parent sees it exit, so
        look at the local ranks for up to a second before settling for gloo's message."""
        deadline = time.monotonic() + 1.0
        while (lost := self.lost_rank()) is None and self.local_ranks is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        return GroupFailed(lost or f"a tensor-parallel collective failed: {error}")

    def lost_rank(self) -> str | None:
        """A local rank that exited (ranks on other machines are noticed at the next collective)."""
        return self.local_ranks.lost() if self.local_ranks is not None else None

    def close(self) -> None:
        """Stop the other ranks (those started here are waited for)."""
        if self.closed:
            return
        self.closed = True
        told = False
        try:
            if self.lost_rank() is None:
                self.channel.send(Kind.STOP)
                told = True
        except RuntimeError:
            pass  # a rank is gone already
        if self.local_ranks is not None:
            self.local_ranks.stop(told=told)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def check_shards(model_dir: str | Path, settings: Settings) -> None:
    """What every rank checks as it builds its shard, checked once before any rank starts: heads
    that do not split over the ranks, or a setting that needs one rank, are one clear
    ``ValueError`` rather than ranks that fail apart."""
    from worker_svc.config import ModelConfig
    from worker_svc.layers.linear import kv_heads_per_rank

    n = settings.num_ranks
    if n == 1:
        return
    if settings.quantization != "none":
        raise ValueError(f"--quantization {settings.quantization} runs on CPU with one rank (here: {n} ranks)")
    config = ModelConfig.from_pretrained(model_dir)
    tp = TensorParallel(0, n)
    tp.split(config.num_heads, "the number of attention heads")
    kv_heads_per_rank(config.num_kv_heads, tp)


def start_runner(model_dir: str | Path, settings: Settings):
    """Rank 0's runner: a ``ModelRunner`` for one rank, a ``DriverRunner`` for several."""
    from worker_svc.runner import ModelRunner, RunnerConfig

    n = settings.num_ranks
    if n == 1:
        _set_threads(settings.num_threads)  # the offline LLM's num_threads (the worker process sets its own too)
        return ModelRunner(model_dir, RunnerConfig.from_settings(settings))
    check_shards(model_dir, settings)
    import torch.distributed as dist

    config = _runner_config(settings, 0)
    local_ranks = None
    if settings.rank is None:  # all ranks here: start the others
        host, port = _store_address(settings) if settings.distributed_init else ("127.0.0.1", 0)
        store = dist.TCPStore(host, port, n, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        _set_threads(local_threads(settings))
        local_ranks = LocalRanks(settings, host, store.port)
        try:
            local_ranks.wait_joined(store, JOIN_TIMEOUT)
        except BaseException:
            local_ranks.stop()
            raise
    else:
        host, port = _store_address(settings)
        store = dist.TCPStore(host, port, n, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        _set_threads(settings.num_threads)
    try:
        tp, channel = _join(0, n, store, config.device)
        runner = ModelRunner(model_dir, config, tp)
    except BaseException:
        if local_ranks is not None:
            local_ranks.stop()
        raise
    log.info("tensor-parallel rank 0 of %d ready", n)
    return DriverRunner(runner, channel, local_ranks)


# ---- ranks 1..N-1 -----------------------------------------------------------------------------


def run_rank(model_dir: str | Path, settings: Settings) -> int:
    """``pagewire worker --rank R`` (R > 0): join, load this rank's shard, run rank 0's plans; when
    rank 0 says STOP, leave the process group and end the process (exit code 0)."""
    import torch.distributed as dist

    from worker_svc.runner import ModelRunner

    rank, n = settings.rank, settings.num_ranks
    host, port = _store_address(settings)
    store = dist.TCPStore(host, port, n, is_master=False, timeout=JOIN_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    config = _runner_config(settings, rank)
    _set_threads(settings.num_threads)  # rank 0 sets it for the ranks it starts
    tp, channel = _join(rank, n, store, config.device)
    runner = ModelRunner(model_dir, config, tp)
    log.info("tensor-parallel rank %d of %d ready", rank, n)
    code = follow(runner, channel)
    dist.destroy_process_group()
    leave(code)


def leave(code: int):
    """End a process that joined a tensor-parallel group (and left it) now, with ``code``: torch's
    objects torn down at interpreter exit can find gloo's threads still joinable and abort the
    process ("terminate called without an active exception", SIGABRT instead of ``code``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def follow(runner, channel: PlanChannel) -> int:
    """Run every plan rank 0 hands over, until it says STOP. A collective that fails (rank 0 or a
    peer is gone) raises: the rank exits."""
    while True:
        kind, token_ids, payload = channel.receive()
        if kind is Kind.STOP:
            log.info("tensor-parallel rank %d stopping", runner.tp.rank)
            return 0
        if kind is Kind.RESET:
            runner.reset()
            continue
        runner.take_sampled(token_ids)
        plan = wire.plan_from_pb(_parse_plan(payload))
        try:
            runner.execute(plan)
        except (KeyError, ValueError) as e:  # rank 0 refuses the same plan; a RESET follows
            log.warning("step plan %d refused: %s", plan.step_id, e)


def _parse_plan(payload: bytes):
    from pagewire_common.v1 import worker_pb2

    return worker_pb2.StepPlan.FromString(payload)
