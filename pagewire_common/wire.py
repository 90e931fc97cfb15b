"""Conversions between the domain types and their protobuf messages, at the service edges.

Bulk integer arrays travel as little-endian bytes and are read with numpy, without a Python
loop per element. Torch-free: the scheduler uses this module.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from pagewire_common.plan import NewSequence, StepPlan, StepResult
from pagewire_common.sampling import DEFAULT_SAMPLING, SamplingParams
from pagewire_common.v1 import generation_pb2 as gen_pb
from pagewire_common.v1 import worker_pb2 as worker_pb

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")

# sampling parameter sets remembered in each direction, and the largest one (serialized) remembered
_SAMPLING_MEMO_SIZE = 256
_SAMPLING_MEMO_MAX_BYTES = 1024
# the files a tokenizer is made of: the worker sends them in ``Info`` and the core passes them on
# to the API servers in ``CoreInfo``, so neither needs the model directory
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def tokenizer_eos_token_id(files: dict[str, bytes]) -> int | None:
    """The id of the tokenizer's EOS token (``tokenizer_config.json``'s ``eos_token`` looked up in
    ``tokenizer.json``: added tokens first, then the model's vocabulary), or None. Plain JSON, so
    the core learns it without a tokenizer (the API servers' ``Tokenizer`` agrees; tests check)."""
    if "tokenizer.json" not in files or "tokenizer_config.json" not in files:
        return None
    eos = json.loads(files["tokenizer_config.json"]).get("eos_token")
    if isinstance(eos, dict):  # an AddedToken serialised as a dict
        eos = eos.get("content")
    if not eos:
        return None
    tokenizer = json.loads(files["tokenizer.json"])
    for token in tokenizer.get("added_tokens") or ():
        if token.get("content") == eos:
            return int(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(eos)
    if isinstance(vocab, list):  # Unigram: [token, score] pairs, the id is the position
        return next((i for i, (token, _) in enumerate(vocab) if token == eos), None)
    return None


def _ints(data: bytes, dtype: np.dtype) -> list[int]:
    return np.frombuffer(data, dtype=dtype).tolist()


def _bytes(values, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


# ---- sampling -------------------------------------------------------------------------------


def sampling_from_pb(msg: gen_pb.SamplingParams) -> SamplingParams:
    """Protobuf -> SamplingParams; proto3 defaults map to the documented ones. ValueError on
    out-of-range values.

    Served requests mostly share a handful of parameter sets, and building and validating the
    frozen SamplingParams costs ~12 us against ~1 us for serializing the message, so the result
    is memoized by the message's bytes, for messages of up to _SAMPLING_MEMO_MAX_BYTES (a schema
    or a long stop list is decoded each time; an invalid message raises each time)."""
    data = msg.SerializeToString(deterministic=True)
    return _memo_sampling_from_pb(data) if len(data) <= _SAMPLING_MEMO_MAX_BYTES else _decode_sampling(msg)


@functools.lru_cache(maxsize=_SAMPLING_MEMO_SIZE)
def _memo_sampling_from_pb(data: bytes) -> SamplingParams:
    return _decode_sampling(gen_pb.SamplingParams.FromString(data))


def _decode_sampling(msg: gen_pb.SamplingParams) -> SamplingParams:
    # an unset field, or a zero where zero is not a valid value, means the declared default
    default = DEFAULT_SAMPLING
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else default.top_p,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_tokens=int(msg.max_tokens) or default.max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
        logprobs=bool(msg.logprobs),
        n=int(msg.n) or default.n,
        min_p=float(msg.min_p),
        repetition_penalty=float(msg.repetition_penalty) or default.repetition_penalty,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        logit_bias=dict(msg.logit_bias),
        min_tokens=int(msg.min_tokens),
        top_logprobs=int(msg.top_logprobs),
        json_schema=msg.json_schema or None,
        regex=msg.regex or None,
        grammar=msg.grammar or None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=bool(msg.include_stop_str_in_output),
    )


def sampling_to_pb(params: SamplingParams) -> gen_pb.SamplingParams:
    """SamplingParams -> a new protobuf message."""
    msg = gen_pb.SamplingParams()
    msg.CopyFrom(_shared_sampling_pb(params))
    return msg


def _shared_sampling_pb(params: SamplingParams) -> gen_pb.SamplingParams:
    """The message for ``params``, memoized by the frozen params when they are small (as in
    :func:`sampling_from_pb`): shared, so callers copy it (a message field's constructor does).
    The last small params' message is also kept by identity: served requests with the same
    parameters share one ``SamplingParams`` (``sampling_from_pb``'s memo), and looking it up
    again costs a hash of every field."""
    global _last_shared_sampling
    last = _last_shared_sampling
    if last is not None and last[0] is params:
        return last[1]
    size = (len(params.json_schema or "") + len(params.regex or "") + len(params.grammar or "")
            + sum(len(s) for s in params.stop) + 8 * (len(params.logit_bias) + len(params.stop_token_ids)))
    if size > _SAMPLING_MEMO_MAX_BYTES:
        return _encode_sampling(params)
    msg = _memo_sampling_to_pb(params)
    _last_shared_sampling = (params, msg)
    return msg


# (params, message) of the last small params _shared_sampling_pb encoded (frozen: the same object
# always gives the same message)
_last_shared_sampling: tuple[SamplingParams, gen_pb.SamplingParams] | None = None


@functools.lru_cache(maxsize=_SAMPLING_MEMO_SIZE)
def _memo_sampling_to_pb(params: SamplingParams) -> gen_pb.SamplingParams:
    return _encode_sampling(params)


def _encode_sampling(params: SamplingParams) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        n=params.n,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        top_logprobs=params.top_logprobs,
        json_schema=params.json_schema or "",
        regex=params.regex or "",
        grammar=params.grammar or "",
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


# ---- step plan ------------------------------------------------------------------------------


def plan_to_pb(plan: StepPlan) -> worker_pb.StepPlan:
    msg = worker_pb.StepPlan(step_id=plan.step_id)
    new_seqs = msg.new_seqs
    for s in plan.new_seqs:
        new_seqs.add(  # built in place: append would copy a message built apart
            seq_id=s.seq_id,
            token_ids=_bytes(s.token_ids, _I32),
            block_ids=_bytes(s.block_ids, _I32),
            num_computed_tokens=s.num_computed_tokens,
            num_scheduled_tokens=s.num_scheduled_tokens,
            sampling=_shared_sampling_pb(s.sampling),  # copied in
            num_prompt_tokens=s.num_prompt_tokens,
            stop_token_ids=_bytes(s.stop_token_ids, _I32) if s.stop_token_ids else b"",
        )
    if len(plan.running_seq_ids):
        msg.running_seq_ids = plan.running_seq_ids.astype(_I64, copy=False).tobytes()
        msg.running_num_scheduled_tokens = plan.running_num_scheduled_tokens.astype(_I32).tobytes()
        updates = plan.block_updates
        if updates:
            msg.block_update_rows = _bytes([u[0] for u in updates], _I32)
            msg.block_update_starts = _bytes([u[1] for u in updates], _I32)
            msg.block_update_lengths = _bytes([len(u[2]) for u in updates], _I32)
            msg.block_update_ids = _bytes([b for u in updates for b in u[2]], _I32)
    if plan.finished_seq_ids:
        msg.finished_seq_ids = _bytes(plan.finished_seq_ids, _I64)
    if plan.block_copies:
        msg.block_copies = _bytes(plan.block_copies, _I32)
    return msg


def plan_from_pb(msg: worker_pb.StepPlan) -> StepPlan:
    new_seqs = [
        NewSequence(
            seq_id=s.seq_id,
            token_ids=_ints(s.token_ids, _I32),
            block_ids=_ints(s.block_ids, _I32),
            num_computed_tokens=s.num_computed_tokens,
            num_scheduled_tokens=s.num_scheduled_tokens,
            sampling=sampling_from_pb(s.sampling),
            num_prompt_tokens=s.num_prompt_tokens,
            stop_token_ids=tuple(_ints(s.stop_token_ids, _I32)),
        )
        for s in msg.new_seqs
    ]
    seq_ids = np.frombuffer(msg.running_seq_ids, dtype=_I64)
    counts = np.frombuffer(msg.running_num_scheduled_tokens, dtype=_I32)
    if len(seq_ids) != len(counts):
        raise ValueError("step plan: running_seq_ids and running_num_scheduled_tokens differ in length")
    updates = []
    if msg.block_update_rows:
        ids = np.frombuffer(msg.block_update_ids, dtype=_I32)
        offset = 0
        for row, start, length in zip(
            _ints(msg.block_update_rows, _I32),
            _ints(msg.block_update_starts, _I32),
            _ints(msg.block_update_lengths, _I32),
        ):
            if not 0 <= row < len(seq_ids):
                raise ValueError(f"step plan: block update for row {row} of {len(seq_ids)} running rows")
            updates.append((row, start, ids[offset : offset + length].tolist()))
            offset += length
    copies = np.frombuffer(msg.block_copies, dtype=_I32).reshape(-1, 2).tolist()
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=new_seqs,
        running_seq_ids=seq_ids,
        running_num_scheduled_tokens=counts,
        block_updates=updates,
        finished_seq_ids=_ints(msg.finished_seq_ids, _I64),
        block_copies=[(a, b) for a, b in copies],
    )


# ---- step result ----------------------------------------------------------------------------


def result_to_pb(result: StepResult) -> worker_pb.StepResult:
    msg = worker_pb.StepResult(
        step_id=result.step_id,
        seq_ids=_bytes(result.seq_ids, _I64),
        token_ids=_bytes(result.token_ids, _I32),
    )
    if result.logprobs is not None:
        msg.logprobs = _bytes(result.logprobs, _F32)
    if result.num_top_logprobs:
        msg.num_top_logprobs = result.num_top_logprobs
        msg.top_token_ids = _bytes(result.top_token_ids, _I32)
        msg.top_logprobs = _bytes(result.top_logprobs, _F32)
    if result.prompt_seq_ids:
        msg.prompt_seq_ids = _bytes(result.prompt_seq_ids, _I64)
        msg.prompt_starts = _bytes(result.prompt_starts, _I32)
        msg.prompt_counts = _bytes(result.prompt_counts, _I32)
        msg.prompt_logprobs = _bytes(result.prompt_logprobs, _F32)
        if result.num_prompt_top_logprobs:
            msg.num_prompt_top_logprobs = result.num_prompt_top_logprobs
            msg.prompt_top_token_ids = _bytes(result.prompt_top_token_ids, _I32)
            msg.prompt_top_logprobs = _bytes(result.prompt_top_logprobs, _F32)
    return msg


def result_from_pb(msg: worker_pb.StepResult) -> StepResult:
    result = _result_from_pb(msg)
    if msg.prompt_seq_ids:
        k = msg.num_prompt_top_logprobs
        result.prompt_seq_ids = _ints(msg.prompt_seq_ids, _I64)
        result.prompt_starts = _ints(msg.prompt_starts, _I32)
        result.prompt_counts = _ints(msg.prompt_counts, _I32)
        result.prompt_logprobs = np.frombuffer(msg.prompt_logprobs, dtype=_F32)
        result.num_prompt_top_logprobs = k
        num_entries = len(result.prompt_logprobs)
        if k:
            result.prompt_top_token_ids = np.frombuffer(msg.prompt_top_token_ids, dtype=_I32).reshape(-1, k)
            result.prompt_top_logprobs = np.frombuffer(msg.prompt_top_logprobs, dtype=_F32).reshape(-1, k)
        else:
            result.prompt_top_token_ids = np.zeros((num_entries, 0), dtype=np.int32)
            result.prompt_top_logprobs = np.zeros((num_entries, 0), dtype=np.float32)
        if sum(result.prompt_counts) != num_entries or len(result.prompt_top_token_ids) != num_entries:
            raise ValueError("step result: prompt logprob arrays disagree with prompt_counts")
    return result


def _result_from_pb(msg: worker_pb.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        seq_ids=_ints(msg.seq_ids, _I64),
        token_ids=_ints(msg.token_ids, _I32),
        logprobs=np.frombuffer(msg.logprobs, dtype=_F32).tolist() if msg.logprobs else None,
        num_top_logprobs=msg.num_top_logprobs,
        top_token_ids=_ints(msg.top_token_ids, _I32) if msg.num_top_logprobs else None,
        top_logprobs=np.frombuffer(msg.top_logprobs, dtype=_F32).tolist() if msg.num_top_logprobs else None,
    )
