"""What the scheduler core sends each API server: one ``CoreOutputs`` per step with that server's
new tokens (``ApiClient`` gathers them), and ``deliver``, which sorts a step's tokens by API
server: the plain decodes with numpy (a request id names its API server in its high bits), the
rest one by one.
"""

from __future__ import annotations

import grpc
import numpy as np

from pagewire_common.core_messages import CoreError, CoreOutputs, api_server_of
from pagewire_common.eventloop import Outbox
from pagewire_common.framelink import LinkClosed
from scheduler_svc.core.running_batch import StepTokens

NAN = float("nan")
_F32 = np.dtype("<f4")


class ApiClient:
    """One API server's Connect session: its requests in flight, and the step's outputs for it."""

    def __init__(self, api_server_id: int, peer: str = "", send=None):
        self.api_server_id = api_server_id
        self.peer = peer
        self.request_ids: set[int] = set()  # its requests (and samples) in flight in the core
        self.ready = False  # it knows the model and serves clients
        self.num_outputs_sent = 0  # CoreOutputs with tokens sent in this session...
        self.num_outputs_done = 0  # ...and how many of them the API server has handed on
        self.unresponsive = False  # behind for longer than BACKPRESSURE_TIMEOUT_S: not waited for
        self.outbox = Outbox()
        self.send = send or self.outbox.put_nowait  # takes each CoreOutputs
        self._clear()

    def _clear(self) -> None:
        # the step's tokens: entries one by one (out_ids, out_tokens, ...), then plain decodes as
        # arrays (no logprobs, not finished, not a first token), which follow them in the message
        self.out_ids: list[int] = []
        self.out_tokens: list[int] = []
        self.out_id_arrays: list[np.ndarray] = []
        self.out_token_arrays: list[np.ndarray] = []
        self.out_logprobs: list[float] = []
        self.any_logprobs = False
        # (token ids, logprobs) of each entry's most likely tokens, once some request asked
        self.out_top: list[tuple[list[int], list[float]] | None] | None = None
        self.outputs = CoreOutputs()

    @property
    def has_output(self) -> bool:
        out = self.outputs
        return bool(self.out_ids or self.out_id_arrays or out.finished_ids or out.errors)

    def flush(self) -> None:
        """Send what this step produced for this API server as one message."""
        out = self.outputs
        if self.out_ids or self.out_id_arrays:
            out.request_ids = np.concatenate([np.asarray(self.out_ids, dtype=np.int64), *self.out_id_arrays])
            out.token_ids = np.concatenate([np.asarray(self.out_tokens, dtype=np.int64), *self.out_token_arrays])
            num_plain = sum(len(ids) for ids in self.out_id_arrays)
            if self.any_logprobs:
                out.logprobs = np.asarray(self.out_logprobs + [NAN] * num_plain, dtype=_F32)
            if self.out_top is not None:
                out.top_token_ids, out.top_logprobs = _top_logprob_arrays(self.out_top + [None] * num_plain)
        if out.has_tokens:
            self.num_outputs_sent += 1
        self._clear()
        try:
            self.send(out)
        except LinkClosed:  # the API server is gone: its session's end aborts its requests
            pass

    @property
    def is_behind(self) -> bool:
        """More than the latest step's message is still unhandled at the API server (one that
        stopped answering is not waited for until it catches up again)."""
        return self.num_outputs_sent - self.num_outputs_done > 1 and not self.unresponsive

    def error(self, request_id: int, code: grpc.StatusCode, message: str) -> None:
        self.outputs.errors.append(CoreError(request_id, code.value[0], message))


def deliver(step: StepTokens, clients: dict[int, ApiClient]) -> None:
    """Each sequence of ``step`` got one token: add it to its API server's message, and send one
    message to each API server that has something. Plain decodes go as arrays, grouped by the API
    server their id names; the others one by one, with logprobs, the first token's cache figure
    and the finish."""
    touched: set[ApiClient] = set()
    if len(step.seq_ids):
        ids, tokens = step.seq_ids, step.token_ids
        servers = api_server_of(ids)
        first = servers[0]
        groups = [first] if (servers == first).all() else np.unique(servers).tolist()
        for server in groups:
            client = clients.get(int(server))
            if client is None:
                continue  # gone: its requests were aborted (not running), so none is here
            if len(groups) == 1:
                client.out_id_arrays.append(ids)
                client.out_token_arrays.append(tokens)
            else:
                mine = servers == server
                client.out_id_arrays.append(ids[mine])
                client.out_token_arrays.append(tokens[mine])
            touched.add(client)
    client = None
    last_server = -1
    for seq in step.others:
        request_id = seq.seq_id
        server = request_id >> 32
        if server != last_server:  # a step's entries mostly come in runs of one API server
            client, last_server = clients.get(server), server
        if client is None or request_id not in client.request_ids:
            continue
        tokens = seq.token_ids
        sampling = seq.sampling
        client.out_ids.append(request_id)
        client.out_tokens.append(tokens[-1])
        if client.any_logprobs:
            client.out_logprobs.append(seq.logprobs[-1] if sampling.logprobs else NAN)
        elif sampling.logprobs:
            client.any_logprobs = True
            client.out_logprobs = [NAN] * (len(client.out_ids) - 1) + [seq.logprobs[-1]]
        if client.out_top is not None:
            client.out_top.append(seq.top_logprobs[-1] if sampling.top_logprobs else None)
        elif sampling.top_logprobs:
            client.out_top = [None] * (len(client.out_ids) - 1) + [seq.top_logprobs[-1]]
        if len(tokens) == len(seq.prompt_token_ids) + 1:  # its first token
            out = client.outputs
            out.started_ids.append(request_id)
            out.num_cached_prompt_tokens.append(seq.num_cached_prompt_tokens or 0)
            if seq.prompt_logprobs is not None:  # delivered once: the sequence lets go of them
                out.prompt_logprob_ids.append(request_id)
                out.prompt_logprobs.append(seq.prompt_logprobs)
                seq.prompt_logprobs = None
        if seq.finish_reason is not None:
            out = client.outputs
            out.finished_ids.append(request_id)
            out.finish_reasons.append(seq.finish_reason)
            client.request_ids.discard(request_id)
        touched.add(client)
    for client in touched:
        client.flush()


def _top_logprob_arrays(tops: list[tuple[list[int], list[float]] | None]) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's most likely tokens as [entries, k] arrays (k: the most any entry has)."""
    k = max(len(t[0]) for t in tops if t is not None)
    ids = np.zeros((len(tops), k), dtype=np.int32)
    lps = np.full((len(tops), k), NAN, dtype=_F32)
    for i, top in enumerate(tops):
        if top is not None:
            n = len(top[0])
            ids[i, :n] = top[0]
            lps[i, :n] = top[1]
    return ids, lps
