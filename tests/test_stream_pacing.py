"""An API server acknowledges a core message once every stream took its part (the core runs at the
pace the server streams), except a stream whose client reads slowly: it is let go after
LAGGING_STREAM_S, so that it holds up neither the core nor the other streams, and it counts again
once it has caught up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from scheduler_svc.api.core_link import LAGGING_STREAM_S, CoreLink
from scheduler_svc.api.request import StreamOutbox


def _link() -> CoreLink:
    # nothing here connects: the link's channel is only created
    return CoreLink(SimpleNamespace(metrics=None, stream_interval=1), 0, "127.0.0.1:9")


def test_a_message_is_done_once_every_stream_took_its_part():
    async def main():
        link = _link()
        a, b = StreamOutbox(link), StreamOutbox(link)
        link.begin_dispatch()
        a.put_nowait("a1")
        b.put_nowait("b1")
        link.handed_on()
        assert link.num_outputs_done == 0
        assert await a.take() == ["a1"]
        assert link.num_outputs_done == 0  # b has not taken its part
        assert await b.take() == ["b1"]
        assert link.num_outputs_done == 1
        link.handed_on()  # a message with nothing for these streams: done at once
        assert link.num_outputs_done == 2

    asyncio.run(main())


def test_a_stream_that_does_not_take_its_part_is_let_go_and_counts_again_once_caught_up():
    async def main():
        link = _link()
        fast, slow = StreamOutbox(link), StreamOutbox(link)
        link.begin_dispatch()
        fast.put_nowait("f1")
        slow.put_nowait("s1")
        link.handed_on()
        assert await fast.take() == ["f1"]
        await asyncio.sleep(LAGGING_STREAM_S / 2)
        assert link.num_outputs_done == 0  # not yet: a busy server's streams take a while too
        await asyncio.sleep(LAGGING_STREAM_S)
        assert link.num_outputs_done == 1  # the slow one no longer holds it up

        # while it lags, its parts pile up without holding up the next messages
        for step in (2, 3):
            link.begin_dispatch()
            fast.put_nowait(f"f{step}")
            slow.put_nowait(f"s{step}")
            link.handed_on()
            assert await fast.take() == [f"f{step}"]
            assert link.num_outputs_done == step

        # it takes everything and waits for more: caught up, it sets the pace again
        assert await slow.take() == ["s1", "s2", "s3"]
        waiting = asyncio.ensure_future(slow.take())
        await asyncio.sleep(0)
        link.begin_dispatch()
        slow.put_nowait("s4")
        link.handed_on()
        assert link.num_outputs_done == 3  # counted again: done when it takes its part
        assert await waiting == ["s4"]
        assert link.num_outputs_done == 4

    asyncio.run(main())


def test_streams_that_got_their_part_later_are_not_let_go_early():
    async def main():
        link = _link()
        old, new = StreamOutbox(link), StreamOutbox(link)
        link.begin_dispatch()
        old.put_nowait("o1")
        link.handed_on()  # message 1: the timer starts
        await asyncio.sleep(LAGGING_STREAM_S * 0.8)
        link.begin_dispatch()
        new.put_nowait("n2")
        link.handed_on()  # message 2, just before message 1's time is up
        await asyncio.sleep(LAGGING_STREAM_S * 0.4)
        assert link.num_outputs_done == 0  # `old` was let go, `new` still has its time
        assert await new.take() == ["n2"]
        assert link.num_outputs_done == 2

    asyncio.run(main())


def test_a_stream_is_let_go_a_lag_after_its_own_part_not_the_first_stream_s():
    async def main():
        link = _link()
        old, new = StreamOutbox(link), StreamOutbox(link)
        link.begin_dispatch()
        old.put_nowait("o1")
        link.handed_on()  # the timer starts for o1
        await asyncio.sleep(LAGGING_STREAM_S * 0.5)
        link.begin_dispatch()
        new.put_nowait("n2")
        link.handed_on()
        assert await old.take() == ["o1"]  # o1 in time; n2 is due at 1.5 lags
        await asyncio.sleep(LAGGING_STREAM_S * 1.2)  # 1.7 lags in
        return link.num_outputs_done

    assert asyncio.run(main()) == 2


def test_after_a_lost_link_a_stream_counted_in_the_old_session_holds_up_nothing():
    """The counts start again with the new session; a stream that held a part of the old one
    (its handler blocked on a slow client) must not hold up the new session's messages."""
    from scheduler_svc.api.server import ApiServer

    async def main():
        api = ApiServer(["127.0.0.1:9"])
        link = api.links[0]
        stuck, fast = StreamOutbox(link), StreamOutbox(link)
        for _ in range(5):
            link.begin_dispatch()
            stuck.put_nowait("old")
            link.handed_on()
        link._link_lost("the scheduler core is unavailable")  # the new session counts from 0
        done = []
        for _ in range(3):
            link.begin_dispatch()
            fast.put_nowait("new")
            link.handed_on()
            await fast.take()
            done.append(link.num_outputs_done)
        await api.stop()
        return done

    assert asyncio.run(main()) == [1, 2, 3]
