"""An IP-Adapter a request names is loaded before the request is queued, on a thread of the front end's own: while
the load is held (on an event the test controls) the engine keeps stepping other requests and the event loop
answers; the request's first step then finds it loaded."""

import asyncio
import threading

from ip_adapter_reference import build_ip_adapters, request

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine


def test_the_load_happens_before_queueing_and_never_in_a_step(tiny_sd_path, tmp_path):
    folder = build_ip_adapters(tiny_sd_path, tmp_path)
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      ip_adapter_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    store = built.executor.ip_adapters()
    release, loading = threading.Event(), threading.Event()
    where: list[str] = []
    read = store._read_parts

    def held(name, path, *shared):
        where.append(threading.current_thread().name)
        loading.set()
        assert release.wait(120)
        return read(name, path, *shared)

    store._read_parts = held

    async def main():
        engine = AsyncEngine(built.executor, options=built.options)
        await engine.start()
        try:
            prompted = asyncio.ensure_future(engine.submit_many_off_loop([request(1, "face", 0.8)]))
            await asyncio.to_thread(loading.wait, 120)
            plain = (await engine.submit_many_off_loop([request(2, None)]))[0]
            done = await plain.result()  # served while the load is held: no step waits for it
            assert done.ok and not prompted.done()
            release.set()
            handle = (await prompted)[0]
            return await handle.result()
        finally:
            release.set()
            await engine.shutdown()

    result = asyncio.run(main())
    assert result.ok, result.error
    assert len(where) == 1 and "stepserve-engine" not in where[0]  # one load, on the front end's thread
    assert set(store.loaded) == {"face"} and store.loads == 1
