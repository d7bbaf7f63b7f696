"""Batches awaited in asyncio: a thousand at once from one thread, every byte checked."""

import asyncio
import threading

import numpy as np

import umbp

PAGE = 4 << 10
BATCHES = 1000


def test_a_thousand_batches_are_awaited_from_one_event_loop():
    engine = umbp.Engine()
    tier = ((np.arange(BATCHES * PAGE, dtype=np.uint64) * 2654435761) >> 5).astype(np.uint8)
    out = np.full(BATCHES * PAGE, 0xA5, dtype=np.uint8)
    with engine.register(tier) as t, engine.register(out) as d:
        # Batch b restores tier page (b * 7) % BATCHES into out page b.
        batches = [
            engine.start_restore([umbp.Object(b, t, [(b * 7) % BATCHES * PAGE], PAGE, PAGE,
                                              [umbp.Range(0, PAGE, d, b * PAGE)])])
            for b in range(BATCHES)
        ]
        threads = set()

        async def one(batch):
            report = await batch
            threads.add(threading.get_ident())
            return report

        async def main():
            return await asyncio.gather(*(one(b) for b in batches))

        reports = asyncio.run(main())
        assert threads == {threading.get_ident()}
        assert all(r.objects[0].state == umbp.State.COMPLETED for r in reports)
        for b in range(BATCHES):
            src = (b * 7) % BATCHES * PAGE
            assert bytes(out[b * PAGE:(b + 1) * PAGE]) == bytes(tier[src:src + PAGE]), b
        del batches


def test_awaiting_a_done_batch_returns_its_report():
    engine = umbp.Engine()
    src = np.arange(PAGE, dtype=np.uint8)
    dst = np.zeros(PAGE, dtype=np.uint8)
    with engine.register(src) as s, engine.register(dst) as d:
        batch = engine.start_restore([umbp.Object(1, s, [0], PAGE, PAGE, [umbp.Range(0, PAGE, d, 0)])])
        blocking = batch.wait()

        async def main():
            return await batch

        awaited = asyncio.run(main())
        assert [o.state for o in awaited.objects] == [o.state for o in blocking.objects]
        assert bytes(dst) == bytes(src)
        del batch
