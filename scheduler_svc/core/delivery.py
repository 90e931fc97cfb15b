"""What the scheduler core sends each API server: one ``CoreOutput`` per step with that server's
new tokens as packed arrays (``ApiClient``), and ``deliver``, which sorts a step's tokens by API
server: the plain decodes with numpy over the running batch's arrays, the rest one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from pagewire_common.eventloop import Outbox
from pagewire_common.framelink import LinkClosed
from pagewire_common.requests import FinishReason
from pagewire_common.v1 import core_pb2
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.core.running_batch import StepTokens

FINISH_CODES = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH}
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
NAN = float("nan")


class ApiClient:
    """One API server's Connect session: its requests in flight, and the step's outputs for it."""

    def __init__(self, client_id: int, peer: str = "", send=None):
        self.client_id = client_id
        self.peer = peer
        self.rids: dict[int, str] = {}  # rid -> the core's request key
        self.ready = False  # it knows the model and serves clients
        self.num_outputs_sent = 0  # CoreOutput messages with tokens sent in this session...
        self.num_outputs_done = 0  # ...and how many of them the API server has handed on
        self.unresponsive = False  # behind for longer than BACKPRESSURE_TIMEOUT_S: not waited for
        self.outbox = Outbox()
        self.send = send or self.outbox.put_nowait  # takes each CoreOutput
        self._clear()

    def _clear(self) -> None:
        # the step's tokens: entries one by one (out_rids, out_tokens, ...), then plain decodes as
        # arrays (no logprobs, not finished), which follow them in the message
        self.out_rids: list[int] = []
        self.out_tokens: list[int] = []
        self.out_rid_arrays: list[np.ndarray] = []
        self.out_token_arrays: list[np.ndarray] = []
        self.out_logprobs: list[float] = []
        self.any_logprobs = False
        # (token ids, logprobs) of each entry's most likely tokens, once some request asked
        self.out_top: list[tuple[list[int], list[float]] | None] | None = None
        self.finished_rids: list[int] = []
        self.finish_reasons: list[int] = []
        self.started_rids: list[int] = []
        self.started_cached: list[int] = []
        self.errors: list[core_pb2.CoreError] = []

    @property
    def has_output(self) -> bool:
        return bool(self.out_rids or self.out_rid_arrays or self.finished_rids or self.errors)

    def flush(self) -> None:
        """Send what this step produced for this API server as one message."""
        msg = core_pb2.CoreOutput(errors=self.errors)
        if self.out_rids or self.out_rid_arrays:
            msg.rids = np.concatenate([np.asarray(self.out_rids, dtype=_I64), *self.out_rid_arrays],
                                      dtype=_I64).tobytes()
            msg.token_ids = np.concatenate([np.asarray(self.out_tokens, dtype=_I32), *self.out_token_arrays],
                                           dtype=_I32).tobytes()
            num_plain = sum(len(rids) for rids in self.out_rid_arrays)
            if self.any_logprobs:
                msg.logprobs = np.asarray(self.out_logprobs + [NAN] * num_plain, dtype=_F32).tobytes()
            if self.out_top is not None:
                _pack_top_logprobs(msg, self.out_top + [None] * num_plain)
        if self.finished_rids:
            msg.finished_rids = np.asarray(self.finished_rids, dtype=_I64).tobytes()
            msg.finish_reasons = np.asarray(self.finish_reasons, dtype=_I32).tobytes()
        if self.started_rids:
            msg.started_rids = np.asarray(self.started_rids, dtype=_I64).tobytes()
            msg.num_cached_prompt_tokens = np.asarray(self.started_cached, dtype=_I32).tobytes()
        if msg.rids or msg.finished_rids:
            self.num_outputs_sent += 1
        self._clear()
        try:
            self.send(msg)
        except LinkClosed:  # the API server is gone: its session's end aborts its requests
            pass

    @property
    def is_behind(self) -> bool:
        """More than the latest step's message is still unhandled at the API server (one that
        stopped answering is not waited for until it catches up again)."""
        return self.num_outputs_sent - self.num_outputs_done > 1 and not self.unresponsive

    def error(self, rid: int, code: grpc.StatusCode, message: str) -> None:
        self.errors.append(core_pb2.CoreError(rid=rid, code=code.value[0], message=message))


@dataclass(slots=True)
class _Owner:
    client: ApiClient
    rid: int
    first_len: int  # the sequence's length once it has its first output token


def deliver(step: StepTokens, owners: dict[str, _Owner], clients: dict[int, ApiClient]) -> None:
    """Each sequence of ``step`` got one token: add it to its API server's message, and send one
    message to each API server that has something. Plain decodes go by their route (the API server
    and rid the core set on the sequence) as arrays; the others one by one, with logprobs, the
    first token's cache figure and the finish."""
    touched: set[ApiClient] = set()
    if len(step.slots):
        batch, slots = step.batch, step.slots
        client_ids = batch.route_client[slots]
        rids = batch.route_rid[slots]
        tokens = step.token_ids
        first = client_ids[0]
        groups = [first] if (client_ids == first).all() else np.unique(client_ids).tolist()
        for client_id in groups:
            client = clients.get(int(client_id))
            if client is None:
                continue  # gone: its requests were aborted (not running), so none is here
            if len(groups) == 1:
                client.out_rid_arrays.append(rids)
                client.out_token_arrays.append(tokens)
            else:
                mine = client_ids == client_id
                client.out_rid_arrays.append(rids[mine])
                client.out_token_arrays.append(tokens[mine])
            touched.add(client)
        # a request's first token: the API server learns how much of its prompt was cached
        for i in (batch.known[slots] == batch.num_prompt[slots] + 1).nonzero()[0].tolist():
            client = clients.get(int(client_ids[i]))
            if client is not None:
                client.started_rids.append(int(rids[i]))
                client.started_cached.append(batch.seqs[int(slots[i])].num_cached_prompt_tokens or 0)
    for seq in step.others:
        owner = owners.get(seq.request_id)
        if owner is None:
            continue
        client = owner.client
        rid = owner.rid
        tokens = seq.token_ids
        client.out_rids.append(rid)
        client.out_tokens.append(tokens[-1])
        if client.any_logprobs:
            client.out_logprobs.append(seq.logprobs[-1] if seq.sampling.logprobs else NAN)
        elif seq.sampling.logprobs:
            client.any_logprobs = True
            client.out_logprobs = [NAN] * (len(client.out_rids) - 1) + [seq.logprobs[-1]]
        if client.out_top is not None:
            client.out_top.append(seq.top_logprobs[-1] if seq.sampling.top_logprobs else None)
        elif seq.sampling.top_logprobs:
            client.out_top = [None] * (len(client.out_rids) - 1) + [seq.top_logprobs[-1]]
        if len(tokens) == owner.first_len:
            client.started_rids.append(rid)
            client.started_cached.append(seq.num_cached_prompt_tokens or 0)
        reason = seq.finish_reason
        if reason is not None:
            client.finished_rids.append(rid)
            client.finish_reasons.append(FINISH_CODES[reason])
            del owners[seq.request_id]
            del client.rids[rid]
        touched.add(client)
    for client in touched:
        client.flush()


def _pack_top_logprobs(msg: core_pb2.CoreOutput, tops: list[tuple[list[int], list[float]] | None]) -> None:
    """Each entry's most likely tokens as [entries, k] arrays (k: the most any entry has)."""
    k = max(len(t[0]) for t in tops if t is not None)
    ids = np.zeros((len(tops), k), dtype=_I32)
    lps = np.full((len(tops), k), NAN, dtype=_F32)
    for i, top in enumerate(tops):
        if top is not None:
            n = len(top[0])
            ids[i, :n] = top[0]
            lps[i, :n] = top[1]
    msg.num_top_logprobs = k
    msg.top_token_ids = ids.tobytes()
    msg.top_logprobs = lps.tobytes()
