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
