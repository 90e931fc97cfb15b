"""What the OpenAI-door tests share: one stack of separate processes (a worker, a scheduler core and
two API servers) per test module, and the clients that talk to it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai

from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import (
    sampling,
    start_scheduler,
    start_worker,
    stub,
    wait_until,
)

PROMPTS = ["the quick brown fox", "hello world, this is", "once upon a time in", "numbers: 1 2 3"]


def open_stack(model_dir, tmp):
    """A worker and a scheduler core with two API servers (max 8 running, 4 waiting), for a
    module-scoped fixture to yield from: (gRPC address, HTTP URL, model name)."""
    worker, worker_addr = start_worker(model_dir, tmp, extra=["--block-size", "4", "--num-kv-blocks", "400"])
    sched, addr = start_scheduler(worker_addr, tmp, extra=["--api-servers", "2", "--max-num-batched-tokens", "64",
                                                           "--max-num-seqs", "8", "--max-queued-requests", "4"])
    try:
        yield addr, sched.http_url(), stub(addr).GetModelInfo(pb.ModelInfoRequest()).model_name
    finally:
        sched.stop()
        worker.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_text(addr: str, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    responses = list(stub(addr).Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling(max_tokens=max_tokens))))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


def http_json(url: str, path: str, body=None, method: str | None = None) -> tuple[int, dict | str]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def assert_all_blocks_free(addr):
    def done():
        s = stub(addr).GetStats(pb.StatsRequest())
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks and s

    return wait_until(done, timeout=10)
