"""The API server <-> core messages survive their packing exactly (pagewire_common.core_messages)."""

from __future__ import annotations

import math

import numpy as np

from pagewire_common.core_messages import (
    BadRequest,
    CoreError,
    CoreOutputs,
    CoreRequests,
    NewRequest,
    api_server_of,
    first_request_id,
)
from pagewire_common.requests import FinishReason
from pagewire_common.sampling import SamplingParams
from pagewire_common.v1 import core_pb2, generation_pb2


def test_requests_round_trip():
    base = first_request_id(7)
    sent = CoreRequests(
        adds=[NewRequest(base, [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=9, n=2, seed=4)),
              NewRequest(base + 2, [9], SamplingParams(stop=["x"], logprobs=True))],
        abort_ids=[base + 5, base + 6], stop_ids=[base + 8], num_rejected=3, ready=True, num_outputs_done=11)
    got = CoreRequests.from_bytes(sent.to_bytes())
    assert got == sent
    assert api_server_of(np.array([base, base + 2])).tolist() == [7, 7]


def test_adds_encoded_one_by_one_arrive_as_one_message():
    """An API server encodes each add as it takes the request; the turn's message is those and
    the rest concatenated, which reads back as one message with every add, in order."""
    base = first_request_id(3)
    adds = [NewRequest(base + i, [i + 1, 7], SamplingParams(max_tokens=i + 2), f"name-{i}") for i in range(3)]
    sent = CoreRequests(encoded_adds=[CoreRequests.encode_add(a) for a in adds[:2]], adds=[adds[2]],
                        abort_ids=[base + 9], num_outputs_done=4)
    got = CoreRequests.from_bytes(sent.to_bytes())
    assert got.adds == adds and got.abort_ids == [base + 9] and got.num_outputs_done == 4 and got.encoded_adds == []


def test_an_add_the_wire_cannot_carry_fails_alone():
    import pytest

    too_big = SamplingParams()
    object.__setattr__(too_big, "top_k", 2**40)  # past SamplingParams's own check: the encoder's is the last
    with pytest.raises(ValueError):
        CoreRequests.encode_add(NewRequest(5, [1], too_big))
    with pytest.raises(ValueError):
        CoreRequests.encode_add(NewRequest(5, [1], SamplingParams(), "\ud83d"))


def test_an_add_whose_sampling_does_not_decode_becomes_a_bad_request():
    msg = core_pb2.CoreRequests(adds=[core_pb2.CoreAdd(request_id=5, sampling=generation_pb2.SamplingParams(top_p=7.0))])
    (add,) = CoreRequests.from_bytes(msg.SerializeToString()).adds
    assert isinstance(add, BadRequest) and add.request_id == 5 and "top_p" in add.message


def test_outputs_round_trip():
    sent = CoreOutputs(
        request_ids=np.array([5, 6, 5], dtype=np.int64), token_ids=np.array([10, 11, 12], dtype=np.int32),
        logprobs=np.array([-0.5, math.nan, -1.25], dtype=np.float32),
        top_token_ids=np.array([[1, 2], [3, 0], [4, 5]], dtype=np.int32),
        top_logprobs=np.array([[-0.1, -0.2], [-0.3, math.nan], [-0.4, -0.5]], dtype=np.float32),
        finished_ids=[5], finish_reasons=[FinishReason.LENGTH], started_ids=[6], num_cached_prompt_tokens=[32],
        errors=[CoreError(9, 14, "gone")], has_worker_state=True, worker_connected=True, worker_generation=3,
        api_server_id=2)
    got = CoreOutputs.from_bytes(sent.to_bytes())
    assert got.request_ids.tolist() == [5, 6, 5] and got.token_ids.tolist() == [10, 11, 12]
    np.testing.assert_array_equal(got.logprobs, sent.logprobs)
    np.testing.assert_array_equal(got.top_token_ids, sent.top_token_ids)
    np.testing.assert_array_equal(got.top_logprobs, sent.top_logprobs)
    assert (got.finished_ids, got.finish_reasons) == ([5], [FinishReason.LENGTH])
    assert (got.started_ids, got.num_cached_prompt_tokens) == ([6], [32])
    assert got.errors == [CoreError(9, 14, "gone")]
    assert (got.has_worker_state, got.worker_connected, got.worker_generation, got.api_server_id) == (True, True, 3, 2)
    assert got.has_tokens


def test_a_message_without_tokens_does_not_count_for_backpressure():
    got = CoreOutputs.from_bytes(CoreOutputs(errors=[CoreError(1, 3, "bad")]).to_bytes())
    assert not got.has_tokens and got.logprobs is None and got.top_token_ids is None


def test_kv_events_round_trip_in_both_directions():
    from pagewire_common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    big = -(1 << 63) + 5  # hashes use the whole signed 64-bit range
    batch = KVEventBatch(0, 7, [
        BlockStored([11, big], None, [1, 2, 3, 4, 5, 6], 3),
        BlockRemoved([big, 12, (1 << 63) - 1]),
        AllBlocksCleared(),
        BlockStored([13], 11, [7, 8, 9], 3),
    ])
    out = CoreOutputs.from_bytes(CoreOutputs(kv_events=batch).to_bytes())
    assert out.kv_events == batch and not out.has_tokens
    assert CoreOutputs.from_bytes(CoreOutputs().to_bytes()).kv_events is None
    assert CoreRequests.from_bytes(CoreRequests(kv_events=False).to_bytes()).kv_events is False
    assert CoreRequests.from_bytes(CoreRequests(kv_events=True).to_bytes()).kv_events is True
    assert CoreRequests.from_bytes(CoreRequests().to_bytes()).kv_events is None


def test_a_failed_write_to_the_core_ends_the_session_rather_than_the_writer(caplog):
    """Whatever makes a turn's message fail (a bug: adds are checked as they are taken), the API
    server's writer logs it and ends the session, whose reader then fails what was in flight and
    reconnects; the writer itself goes on with later messages."""
    import asyncio
    from types import SimpleNamespace

    from scheduler_svc.api.core_link import CoreLink

    async def run():
        link = CoreLink(SimpleNamespace(metrics=None, stream_interval=1, num_cores=1), 0, "unix:/nonexistent.sock")
        closed, written = [], []
        link._session = SimpleNamespace(close=lambda: closed.append(True), write=written.append)
        writer = asyncio.get_running_loop().create_task(link._write_loop())
        link._out.abort_names.append(12345)  # not a string: the message cannot be encoded
        link._flush_wanted.set()
        await asyncio.sleep(0.01)
        assert closed == [True] and written == [] and not writer.done()
        link.reject()  # a later turn is written
        await asyncio.sleep(0.01)
        assert len(written) == 1 and CoreRequests.from_bytes(written[0]).num_rejected == 1
        writer.cancel()
        await link._channel.close()

    with caplog.at_level("ERROR"):
        asyncio.run(run())
    assert "sending to the scheduler core unix:/nonexistent.sock failed; reconnecting" in caplog.text


def test_a_state_message_while_requests_run_keeps_their_ids_unique():
    """Every worker-state message of a session names the API server's id; one sent while requests
    run (the core starting to drain) must not start the id count again: a new request would take
    a running one's id, and the core's refusal of it would end the running one's stream."""
    import asyncio
    from types import SimpleNamespace

    from pagewire_common.core_messages import CoreOutputs
    from pagewire_common.eventloop import Outbox
    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api.core_link import CoreLink

    async def run():
        server = SimpleNamespace(metrics=None, stream_interval=1, num_cores=1, link_changed=lambda link: None)
        link = CoreLink(server, 0, "unix:/nonexistent.sock")
        ids = []
        for draining in (False, True, False):
            await link._worker_state(CoreOutputs(has_worker_state=True, api_server_id=3, draining=draining))
            assert link.draining == draining
            link.is_serving = True  # as a worker that is up would make it
            ids.append(link.submit("r", [1, 2], SamplingParams(n=2), Outbox()))
        await link._channel.close()
        return ids

    ids = asyncio.run(run())
    assert ids == [(3 << 32) + 1, (3 << 32) + 3, (3 << 32) + 5]
