"""The sweep: jobs that finished more than --keep-results-h hours ago leave the store, and their files (results
and inputs) the results folder, with any file older than that and temporary files a dead writer left; adapter
registrations deleted that long ago leave the store too (every process has acted on them by then). Every
process sweeps every SWEEP_EVERY_S, at start first; sweeping is idempotent, so processes sharing a store and a
folder need not agree on who does it."""

from __future__ import annotations

import asyncio
import logging
import time

from ..store.base import Store
from ..store.results import Results
from .kinds import job_files

log = logging.getLogger("stepserve.jobs")
SWEEP_EVERY_S = 300.0


def sweep_once(store: Store, results: Results) -> int:
    """One sweep; returns how many jobs left the store."""
    before = store.now() - results.keep_s
    old = store.sweep(before)
    for job in old:
        results.delete(job_files(job))
    results.sweep(time.time())
    store.sweep_adapters(before)
    return len(old)


async def sweep_forever(store: Store, results: Results, every_s: float = SWEEP_EVERY_S) -> None:
    while True:
        try:
            swept = await asyncio.to_thread(sweep_once, store, results)
            if swept:
                log.info("jobs: %d finished job(s) older than %g h swept", swept, results.keep_s / 3600)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.exception("jobs: the sweep of %s and %s failed", store.url, results.root)
        await asyncio.sleep(every_s)
