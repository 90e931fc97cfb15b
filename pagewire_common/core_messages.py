"""The messages between an API server and the scheduler core, and the one place that packs them.

An API server sends ``CoreRequests`` (new requests, aborts, stops, its progress); after each step
the core sends each API server one ``CoreOutputs`` with that server's new tokens as arrays, so the
core's cost grows with steps, not with streamed messages. Both travel on the ``Connect`` session's
frame link as the ``core.proto`` messages; ``to_bytes``/``from_bytes`` here are the only code that
converts, and bulk integer arrays cross as little-endian bytes that numpy reads without a loop.

A request has one id from end to end (``request_id``, an int): the API server picks it (its
``api_server_id`` in the high 32 bits, a counter in the low 32), the core uses it as the
sequence id in its plans, the worker keys its state by it, and the core's outputs carry it back.
Sample ``i`` of a request with ``n > 1`` is ``request_id + i``. The client's own id (its
``name``, the public ``request_id`` string) stays in the API server, except that each add carries
it so that the core can refuse a name already running and abort by name (the public ``Abort``,
which may reach any API server).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagewire_common import wire
from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagewire_common.requests import FinishReason, PromptLogprobs
from pagewire_common.sampling import SamplingParams
from pagewire_common.v1 import core_pb2
from pagewire_common.v1 import generation_pb2 as pb

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_U8 = np.dtype("u1")
# KVEvents.kinds
_KV_STORED, _KV_REMOVED, _KV_CLEARED = 1, 2, 3
FINISH_CODES = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH}
FINISH_REASONS = {code: reason for reason, code in FINISH_CODES.items()}
API_SERVER_ID_SHIFT = 32


def first_request_id(api_server_id: int) -> int:
    """The first request id of an API server (its counter starts at 1)."""
    return (api_server_id << API_SERVER_ID_SHIFT) + 1


def api_server_of(request_ids: np.ndarray) -> np.ndarray:
    """The API server id of each request id."""
    return request_ids >> API_SERVER_ID_SHIFT


@dataclass(slots=True)
class NewRequest:
    """A request an API server hands to the core, already validated and tokenized there."""

    request_id: int  # its one id (module docstring); samples of n > 1 take the next n - 1 ids
    prompt_token_ids: list[int]
    sampling: SamplingParams
    name: str = ""  # the client's request_id: unique among running requests, what Abort finds it by
    passable: bool = False  # its API server may offer it to another core: a refusal for room is not counted


@dataclass(slots=True)
class CoreRequests:
    """What an API server queued for the core during one turn of its event loop."""

    # new requests; an add whose sampling parameters did not decode arrives as a BadRequest
    adds: list[NewRequest | BadRequest] = field(default_factory=list)
    abort_ids: list[int] = field(default_factory=list)  # the client went away: counted as aborted
    stop_ids: list[int] = field(default_factory=list)  # a stop string ended it: counted as finished
    num_rejected: int = 0  # requests this server refused since its last message (the core's Stats)
    ready: bool = False  # the server knows the model and serves clients (once per session)
    # CoreOutputs with tokens this server has handed to its streams so far (backpressure: the core
    # runs at most one step ahead of the slowest API server)
    num_outputs_done: int = 0
    # the public Abort by the client's request_id, of a request on any API server (the core
    # answers each with an AbortReply, in order)
    abort_names: list[str] = field(default_factory=list)
    # set when it changes: this server has SubscribeKVEvents streams (True) or none left (False)
    kv_events: bool | None = None
    # adds encoded already (``encode_add``), sent ahead of ``adds``; they arrive in ``adds``
    encoded_adds: list[bytes] = field(default_factory=list)

    @staticmethod
    def encode_add(add: NewRequest) -> bytes:
        """One add as a message of its own. Encoded protobuf messages concatenate into one message
        (repeated fields append), so an API server encodes each add when it takes the request:
        ``ValueError`` there refuses that request alone, where an add that failed in the turn's
        ``to_bytes`` would lose the whole turn's message."""
        return core_pb2.CoreRequests(adds=[core_pb2.CoreAdd(
            request_id=add.request_id, prompt_token_ids=np.asarray(add.prompt_token_ids, dtype=_I32).tobytes(),
            sampling=wire.sampling_to_pb(add.sampling), name=add.name, passable=add.passable)]).SerializeToString()

    def to_bytes(self) -> bytes:
        msg = core_pb2.CoreRequests(num_rejected=self.num_rejected, ready=self.ready,
                                    num_outputs_done=self.num_outputs_done, abort_names=self.abort_names)
        if self.abort_ids:
            msg.abort_ids = np.asarray(self.abort_ids, dtype=_I64).tobytes()
        if self.stop_ids:
            msg.stop_ids = np.asarray(self.stop_ids, dtype=_I64).tobytes()
        if self.kv_events is not None:
            msg.kv_events = self.kv_events
        if self.encoded_adds or self.adds:
            return b"".join([*self.encoded_adds, *map(self.encode_add, self.adds), msg.SerializeToString()])
        return msg.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> "CoreRequests":
        """An add whose sampling parameters cannot be read becomes a ``BadRequest`` in ``adds``:
        the core refuses that request alone, not the whole message."""
        msg = core_pb2.CoreRequests.FromString(data)
        adds = []
        for add in msg.adds:
            try:
                sampling = wire.sampling_from_pb(add.sampling)
            except ValueError as e:
                adds.append(BadRequest(add.request_id, str(e)))
                continue
            adds.append(NewRequest(add.request_id, np.frombuffer(add.prompt_token_ids, dtype=_I32).tolist(), sampling,
                                   add.name, add.passable))
        requests = cls(adds, _ids(msg.abort_ids), _ids(msg.stop_ids), msg.num_rejected, msg.ready, msg.num_outputs_done,
                       list(msg.abort_names))
        if msg.HasField("kv_events"):
            requests.kv_events = msg.kv_events
        return requests


@dataclass(slots=True)
class BadRequest:
    """An add whose sampling parameters did not decode: the core refuses it (INVALID_ARGUMENT)."""

    request_id: int
    message: str


@dataclass(slots=True)
class CoreError:
    """A request the core refused or lost."""

    request_id: int
    code: int  # a grpc.StatusCode value: RESOURCE_EXHAUSTED, INVALID_ARGUMENT, UNAVAILABLE, ...
    message: str


@dataclass(slots=True)
class AbortReply:
    """The core's answer to one name in ``CoreRequests.abort_names``."""

    name: str
    found: bool  # a running request had this name and was aborted


@dataclass(slots=True)
class CoreOutputs:
    """What one step produced for one API server (or, with worker state, the link's news)."""

    # one token each, in order; a request may appear several times
    request_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I64)  # int64
    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32
    # aligned with token_ids, NaN where not asked; None when no request of the step asked
    logprobs: np.ndarray | None = None  # float32
    # [entries, k] most likely tokens (ids, logprobs), best first, when some request asked;
    # a request that asked for fewer takes the first ones, rows of others hold NaN logprobs
    top_token_ids: np.ndarray | None = None  # int32
    top_logprobs: np.ndarray | None = None  # float32
    # requests that ended in the core (after their tokens above), and why
    finished_ids: list[int] = field(default_factory=list)
    finish_reasons: list[FinishReason] = field(default_factory=list)
    # requests whose first token is above, with their prompt tokens served from the prefix cache
    started_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: list[int] = field(default_factory=list)
    # requests whose first token is above and that asked for prompt logprobs (sample 0 of n), with them
    prompt_logprob_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    errors: list[CoreError] = field(default_factory=list)
    # the worker link's state: in the session's first message and whenever it changes
    has_worker_state: bool = False
    worker_connected: bool = False
    worker_generation: int = 0  # changes whenever the core connects to a (new) worker
    draining: bool = False  # the core is shutting down: it takes no new requests
    api_server_id: int = 0  # in the session's first message: the high bits of this server's ids
    # the step's KV-cache events, to an API server that subscribed (alone: not counted in has_tokens)
    kv_events: KVEventBatch | None = None
    abort_replies: list[AbortReply] = field(default_factory=list)  # one per abort name it sent, in order

    @property
    def has_tokens(self) -> bool:
        """Whether this message counts for backpressure (``num_outputs_done``)."""
        return bool(len(self.request_ids) or self.finished_ids)

    def to_bytes(self) -> bytes:
        msg = core_pb2.CoreOutput(has_worker_state=self.has_worker_state, worker_connected=self.worker_connected,
                                  worker_generation=self.worker_generation, api_server_id=self.api_server_id,
                                  draining=self.draining)
        for err in self.errors:
            msg.errors.append(core_pb2.CoreError(request_id=err.request_id, code=err.code, message=err.message))
        for reply in self.abort_replies:
            msg.abort_replies.append(core_pb2.AbortReply(name=reply.name, found=reply.found))
        if len(self.request_ids):
            msg.request_ids = np.asarray(self.request_ids, dtype=_I64).tobytes()
            msg.token_ids = np.asarray(self.token_ids, dtype=_I32).tobytes()
            if self.logprobs is not None:
                msg.logprobs = np.asarray(self.logprobs, dtype=_F32).tobytes()
            if self.top_token_ids is not None:
                msg.num_top_logprobs = self.top_token_ids.shape[1]
                msg.top_token_ids = np.asarray(self.top_token_ids, dtype=_I32).tobytes()
                msg.top_logprobs = np.asarray(self.top_logprobs, dtype=_F32).tobytes()
        if self.finished_ids:
            msg.finished_ids = np.asarray(self.finished_ids, dtype=_I64).tobytes()
            msg.finish_reasons = np.asarray([FINISH_CODES[r] for r in self.finish_reasons], dtype=_I32).tobytes()
        if self.started_ids:
            msg.started_ids = np.asarray(self.started_ids, dtype=_I64).tobytes()
            msg.num_cached_prompt_tokens = np.asarray(self.num_cached_prompt_tokens, dtype=_I32).tobytes()
        if self.prompt_logprob_ids:
            plps = self.prompt_logprobs
            msg.prompt_logprob_ids = np.asarray(self.prompt_logprob_ids, dtype=_I64).tobytes()
            msg.prompt_num_entries = np.asarray([len(p.logprobs) for p in plps], dtype=_I32).tobytes()
            msg.prompt_num_top = np.asarray([p.num_top for p in plps], dtype=_I32).tobytes()
            msg.prompt_logprobs = b"".join(np.asarray(p.logprobs, dtype=_F32).tobytes() for p in plps)
            msg.prompt_top_token_ids = b"".join(np.asarray(p.top_token_ids, dtype=_I32).tobytes() for p in plps)
            msg.prompt_top_logprobs = b"".join(np.asarray(p.top_logprobs, dtype=_F32).tobytes() for p in plps)
        if self.kv_events is not None:
            msg.kv_events.CopyFrom(_kv_events_to_pb(self.kv_events))
        return msg.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> "CoreOutputs":
        msg = core_pb2.CoreOutput.FromString(data)
        out = cls(errors=[CoreError(e.request_id, e.code, e.message) for e in msg.errors],
                  has_worker_state=msg.has_worker_state, worker_connected=msg.worker_connected,
                  worker_generation=msg.worker_generation, api_server_id=msg.api_server_id, draining=msg.draining,
                  abort_replies=[AbortReply(r.name, r.found) for r in msg.abort_replies])
        if msg.request_ids:
            out.request_ids = np.frombuffer(msg.request_ids, dtype=_I64)
            out.token_ids = np.frombuffer(msg.token_ids, dtype=_I32)
            if msg.logprobs:
                out.logprobs = np.frombuffer(msg.logprobs, dtype=_F32)
            k = msg.num_top_logprobs
            if k:
                out.top_token_ids = np.frombuffer(msg.top_token_ids, dtype=_I32).reshape(-1, k)
                out.top_logprobs = np.frombuffer(msg.top_logprobs, dtype=_F32).reshape(-1, k)
        if msg.finished_ids:
            out.finished_ids = _ids(msg.finished_ids)
            out.finish_reasons = [FINISH_REASONS[c] for c in np.frombuffer(msg.finish_reasons, dtype=_I32).tolist()]
        if msg.started_ids:
            out.started_ids = _ids(msg.started_ids)
            out.num_cached_prompt_tokens = np.frombuffer(msg.num_cached_prompt_tokens, dtype=_I32).tolist()
        if msg.prompt_logprob_ids:
            out.prompt_logprob_ids = _ids(msg.prompt_logprob_ids)
            out.prompt_logprobs = _prompt_logprobs_from_pb(msg)
        if msg.HasField("kv_events"):
            out.kv_events = _kv_events_from_pb(msg.kv_events)
        return out


def _prompt_logprobs_from_pb(msg: core_pb2.CoreOutput) -> list[PromptLogprobs]:
    logprobs = np.frombuffer(msg.prompt_logprobs, dtype=_F32)
    top_ids = np.frombuffer(msg.prompt_top_token_ids, dtype=_I32)
    top_lps = np.frombuffer(msg.prompt_top_logprobs, dtype=_F32)
    out = []
    e = t = 0
    for n, k in zip(np.frombuffer(msg.prompt_num_entries, dtype=_I32).tolist(),
                    np.frombuffer(msg.prompt_num_top, dtype=_I32).tolist()):
        out.append(PromptLogprobs(logprobs[e : e + n], top_ids[t : t + n * k].reshape(n, k),
                                  top_lps[t : t + n * k].reshape(n, k)))
        e += n
        t += n * k
    return out


def _kv_events_to_pb(batch: KVEventBatch) -> core_pb2.KVEvents:
    kinds, num_hashes, hashes, parents, has_parent, token_ids = [], [], [], [], [], []
    block_size = 0
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            kinds.append(_KV_CLEARED)
            num_hashes.append(0)
            continue
        num_hashes.append(len(event.block_hashes))
        hashes.extend(event.block_hashes)
        if isinstance(event, BlockRemoved):
            kinds.append(_KV_REMOVED)
            continue
        kinds.append(_KV_STORED)
        has_parent.append(event.parent_block_hash is not None)
        parents.append(0 if event.parent_block_hash is None else event.parent_block_hash)
        token_ids.extend(event.token_ids)
        block_size = event.block_size
    return core_pb2.KVEvents(
        core_index=batch.core_index, seq=batch.seq, block_size=block_size,
        kinds=np.asarray(kinds, dtype=_I32).tobytes(), num_hashes=np.asarray(num_hashes, dtype=_I32).tobytes(),
        block_hashes=np.asarray(hashes, dtype=_I64).tobytes(), parent_block_hashes=np.asarray(parents, dtype=_I64).tobytes(),
        has_parent=np.asarray(has_parent, dtype=_U8).tobytes(), token_ids=np.asarray(token_ids, dtype=_I32).tobytes())


def _kv_events_from_pb(msg: core_pb2.KVEvents) -> KVEventBatch:
    hashes = np.frombuffer(msg.block_hashes, dtype=_I64).tolist()
    parents = np.frombuffer(msg.parent_block_hashes, dtype=_I64).tolist()
    has_parent = np.frombuffer(msg.has_parent, dtype=_U8).tolist()
    token_ids = np.frombuffer(msg.token_ids, dtype=_I32).tolist()
    block_size = msg.block_size
    batch = KVEventBatch(msg.core_index, msg.seq)
    h = stored = t = 0
    for kind, n in zip(np.frombuffer(msg.kinds, dtype=_I32).tolist(), np.frombuffer(msg.num_hashes, dtype=_I32).tolist()):
        if kind == _KV_CLEARED:
            batch.events.append(AllBlocksCleared())
        elif kind == _KV_REMOVED:
            batch.events.append(BlockRemoved(hashes[h : h + n]))
        else:
            parent = parents[stored] if has_parent[stored] else None
            batch.events.append(BlockStored(hashes[h : h + n], parent, token_ids[t : t + n * block_size], block_size))
            stored += 1
            t += n * block_size
        h += n
    return batch


def _ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_I64).tolist() if data else []
