"""A ControlNet a request names is loaded before the request is queued, on a thread of the front end's own: while
the load is held (on an event the test controls) the engine keeps stepping other requests and the event loop
answers; the request's first step then finds it loaded."""

import asyncio
import threading

from control_reference import build_controlnets, request

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine


def test_the_load_happens_before_queueing_and_never_in_a_step(tiny_sd_path, tmp_path):
    folder = build_controlnets(tiny_sd_path, tmp_path)
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    store = built.executor.controlnets()
    release, loading = threading.Event(), threading.Event()
    where: list[str] = []
    load = store._load

    def held(name, keep):
        where.append(threading.current_thread().name)
        loading.set()
        assert release.wait(120)
        return load(name, keep)

    store._load = held

    async def main():
        engine = AsyncEngine(built.executor, options=built.options)
        await engine.start()
        try:
            controlled = asyncio.ensure_future(engine.submit_many_off_loop([request(1, (("pose", 1.0, 0, 1),))]))
            await asyncio.to_thread(loading.wait, 120)
            plain = (await engine.submit_many_off_loop([request(2, ())]))[0]
            done = await plain.result()  # served while the load is held: no step waits for it
            assert done.ok and not controlled.done()
            release.set()
            handle = (await controlled)[0]
            return await handle.result()
        finally:
            release.set()
            await engine.shutdown()

    result = asyncio.run(main())
    assert result.ok, result.error
    assert len(where) == 1 and "stepserve-engine" not in where[0]  # one load, on the front end's thread
    assert "pose" in store.loaded
