"""The bench's HTTP target sends an edit request to /v1/images/edits (multipart: image, mask, fields) and reads
the answer like a generation's: it runs the steps its strength leaves."""

import asyncio

from stepserve.bench.targets import OK, HttpTarget
from stepserve.bench.workload import RequestSpec


def test_http_target_sends_edits(serve):
    specs = [RequestSpec("a cat", seed=1, num_inference_steps=8, height=16, width=16, edit="image", strength=0.5,
                         image=3),
             RequestSpec("a cat", seed=2, num_inference_steps=8, height=16, width=16, edit="inpaint", strength=0.75,
                         image=4),
             RequestSpec("a cat", seed=3, num_inference_steps=8, height=16, width=16)]

    async def main(url):
        target = HttpTarget(url)
        await target.start()
        try:
            return await asyncio.gather(*(target.send(s) for s in specs))
        finally:
            await target.stop()

    with serve(strategy="continuous") as server:
        replies = asyncio.run(main(server.url))
    assert [r.status for r in replies] == [OK] * 3, [r.error for r in replies]
    assert [len(r.batch_sizes) for r in replies] == [4, 6, 8]
