"""Which engine cores an API server takes requests for: the first core's model is the served one;
another core must serve the same model with the same limits (requests are checked against them
before a core is chosen, and routed by prompt blocks of its size), else it takes none, says so, and
its figures stay out of the summed stats."""

from __future__ import annotations

import asyncio
import logging

from pagewire_common.v1 import core_pb2
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.server import ApiServer


def _info(name: str = "m", **limits) -> core_pb2.CoreInfoResponse:
    return core_pb2.CoreInfoResponse(model_name=name, **{"max_model_len": 64, "vocab_size": 100, "block_size": 4,
                                                         **limits})


def test_a_core_with_other_limits_or_another_model_takes_no_requests(caplog):
    async def main():
        api = ApiServer(["127.0.0.1:9", "127.0.0.1:10"])  # nothing connects: the links' state is set here
        first, other = api.links
        served = []
        for link, info in ((first, _info()), (other, _info(max_model_len=32)), (other, _info(block_size=8)),
                           (other, _info("another")), (other, _info())):
            link.core_connected = link.worker_connected = True
            link.info = info
            await link.adopt()
            served.append((link.is_serving, link.mismatched))

        async def stats(link):
            return pb.Stats(num_total_blocks=100 * (link.index + 1), worker_connected=True)

        for link in api.links:
            link.stats = lambda link=link: stats(link)
        summed_with_both = (await api.stats()).num_total_blocks
        other.mismatched = True  # as after a refused adoption
        summed_without = (await api.stats()).num_total_blocks
        await api.stop()
        return served, summed_with_both, summed_without

    with caplog.at_level(logging.ERROR, logger="pagewire.api"):
        served, summed_with_both, summed_without = asyncio.run(main())
    assert served == [(True, False), (False, True), (False, True), (False, True), (True, False)]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "engine core 1 (127.0.0.1:10) serves 'm' with max_model_len 32 (the others 64): it takes no requests",
        "engine core 1 (127.0.0.1:10) serves 'm' with block_size 8 (the others 4): it takes no requests",
        "engine core 1 (127.0.0.1:10) serves 'another', the others 'm': it takes no requests",
    ]
    assert (summed_with_both, summed_without) == (300, 100)


def test_a_request_refused_for_room_or_lost_before_it_started_goes_to_another_core():
    """Each API server sees the other servers' load on a core a poll late, and a core can die just
    as a request reaches it: a request refused for want of room, or lost, before anything of it
    reached the client, is handed to a core that has not refused or lost it; with none left, the
    last failure is the answer."""
    import grpc
    import pytest

    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api.request import ApiRequest, RequestError

    async def main():
        api = ApiServer(["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"], routing="round-robin")
        for link in api.links:
            link.core_connected = link.worker_connected = True
            link.info = _info(max_num_seqs=4)
            await link.adopt()
        request = ApiRequest(api.route([1, 2, 3], 1), "r", [1, 2, 3], SamplingParams(n=2))
        deltas = request.__aiter__()
        waiting = asyncio.ensure_future(anext(deltas))
        cores = [request.api.index]
        for code, message in ((grpc.StatusCode.RESOURCE_EXHAUSTED, "no room to start it now"),
                              (grpc.StatusCode.UNAVAILABLE, "engine core is unavailable")):
            request.api.fail_pending(code, message)
            await asyncio.sleep(0)
            assert not waiting.done()
            cores.append(request.api.index)
            assert {request.id, request.id + 1} <= set(request.api.pending)  # both samples, on the new core
        request.api.fail_pending(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        with pytest.raises(RequestError) as refused:
            await waiting
        # the cores left a refusal for room uncounted (the add says it may be passed on): the
        # API server counts the request once, when no core is left to try
        rejected = [link._out.num_rejected for link in api.links]
        not_rerouted = ApiRequest(api.links[0], "s", [4, 5], SamplingParams())
        not_rerouted.api.fail_pending(grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary")
        with pytest.raises(RequestError) as invalid:
            await anext(not_rerouted.__aiter__())
        await api.stop()
        return cores, refused.value, request, invalid.value, not_rerouted, rejected

    cores, refused, request, invalid, not_rerouted, rejected = asyncio.run(main())
    assert sum(rejected) == 1
    assert sorted(cores) == [0, 1, 2]  # each core once
    assert refused.message == "the queue is full" and request.refused
    assert invalid.message == "outside the vocabulary" and not_rerouted.tried_cores == set()


def test_a_request_of_several_samples_fails_once_when_its_only_core_is_lost():
    """Its samples share one outbox: the loss puts one failure on it, which ends the stream with
    that status (two once made the first look like a delta)."""
    import grpc
    import pytest

    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api.request import ApiRequest, RequestError

    async def main():
        api = ApiServer(["127.0.0.1:9"])
        link = api.links[0]
        link.core_connected = link.worker_connected = True
        link.info = _info()
        await link.adopt()
        request = ApiRequest(link, "r", [1, 2, 3], SamplingParams(n=3))
        link._link_lost("the scheduler core is unavailable")
        with pytest.raises(RequestError) as lost:
            await anext(request.__aiter__())
        await api.stop()
        return lost.value

    lost = asyncio.run(main())
    assert (lost.code, lost.message) == (grpc.StatusCode.UNAVAILABLE, "the scheduler core is unavailable")
