"""A worker rank: loads the same model as rank 0, joins the split, and runs every stage rank 0 sends on a mirror of
the same requests, so that its collectives meet rank 0's inside the forward.

Messages (ranks.py's pipe), in rank 0's order:
- ("prepare", [Request], ended, addons): mirror and prepare these requests; answers ("ok",) or ("error", exc);
- ("denoise", [(request_id, step)], ended, addons): one step of these mirrors (the forward's collectives);
- ("ended", ended, addons): forget these requests (decoded on rank 0, cancelled, or failed);
- ("state", ended, addons): answers ("state", what this rank holds) (ParallelExecutor.workers_state);
- ("fast_path", FastPathOptions, max_batch_size, ended, addons): wrap the networks as rank 0 did (--deterministic);
  answers ("ok",) or ("error", why);
- ("stop",): exit.
`ended` lists requests rank 0 has finished with (their holds on ControlNets and IP-Adapters are released);
`addons` what changed in rank 0's loaded add-ons (executor.py `_news`), or None: this rank loads the LoRA adapters
rank 0 has and unloads the others, and unloads the ControlNets and IP-Adapters rank 0 has unloaded that its own
requests do not hold (it loads those when a request needs them), so its memory follows rank 0's budgets: above
them by at most what one prepare loads, until the next message (rank 0 makes room for those during the same
prepare, after it has sent it). A worker that fails a denoising step says why (("fatal", message)) and exits: the
other ranks may be waiting for it inside a collective, and the model cannot go on without it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from .processes import join
from .ranks import STAGE_TIMEOUT

log = logging.getLogger("stepserve.parallel")


def run(conn, rank: int, degrees, store_path: str, device: str, load) -> None:
    """A worker rank's life after start-up (stepserve/engine/rank_worker.py starts the process): `load()` makes its
    executor (the model and the add-on folders rank 0 serves), then it joins the ranks, splits, and serves stages
    until told to stop or rank 0 goes."""
    try:
        import torch

        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "nccl":  # rank r on CUDA device r (diffusers' hooks place it there too)
            torch.cuda.set_device(rank)
        executor = load()
        conn.send(("ready",))
        join(rank, degrees.world, store_path, "cuda" if backend == "nccl" else "cpu", STAGE_TIMEOUT)
        from .split import apply_split

        executor.split = apply_split(executor.pipeline, degrees)
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, which refuses to start
        _fatal(conn, f"rank {rank} could not start: {type(exc).__name__}: {exc}")
        return
    _serve(conn, rank, executor)


def _serve(conn, rank: int, executor) -> None:
    mirrors: dict = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            os._exit(0)
        kind = message[0]
        if kind == "stop":
            os._exit(0)
        *body, ended, addons = message[1:]
        for rid in ended:
            r = mirrors.pop(rid, None)
            if r is not None:
                _release(executor, r)
        if addons is not None:
            try:
                _follow(executor, addons)
            except Exception:  # noqa: BLE001 - what it could not follow fails the requests that need it, here
                log.warning("rank %d could not follow rank 0's add-ons", rank, exc_info=True)
        if kind == "state":
            conn.send(("state", _state(executor)))
        elif kind == "fast_path":  # rank 0 warms up through the stages: no warm-up of this rank's own
            from dataclasses import replace

            from ..backends.fast_path import apply_fast_path

            options, max_batch_size = body
            try:
                apply_fast_path(executor, replace(options, warm_up=False, progress=False), max_batch_size)
                conn.send(("ok",))
            except Exception as exc:  # noqa: BLE001 - rank 0 refuses to start, saying why
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        elif kind == "prepare":
            (requests,) = body
            for r in requests:
                old = mirrors.pop(r.request_id, None)
                if old is not None:
                    _release(executor, old)
                mirrors[r.request_id] = r
            try:
                executor.prepare(requests)
                conn.send(("ok",))
            except Exception as exc:  # noqa: BLE001 - rank 0 raises it there: the batch is split and retried
                conn.send(("error", exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")))
        elif kind == "denoise":
            (steps,) = body
            try:
                batch = []
                for rid, step in steps:
                    r = mirrors[rid]
                    r.step = step
                    batch.append(r)
                executor.denoise(batch)
            except BaseException:  # noqa: BLE001 - see the module docstring
                _fatal(conn, f"rank {rank} failed a denoising step: {traceback.format_exc(limit=3)}")
                return


def _release(executor, r) -> None:
    from ..controls.serving import release as release_controls
    from ..ipadapter.serving import release as release_image_prompts

    r.release_tensors()
    release_controls(executor, r)
    release_image_prompts(executor, r)


def _follow(executor, news: dict) -> None:
    """Hold what rank 0 holds: its LoRA adapters ({name: file}); of the ControlNets and IP-Adapters, no more than
    its (and what this rank's requests hold)."""
    if "lora" in news:
        _sync_loras(executor, news["lora"])
    for kind in ("controlnet", "ip_adapter"):
        store = getattr(executor, f"_{kind}s", None)
        if kind in news and store is not None:
            store.budget.follow(news[kind])


def _state(executor) -> dict:
    stores = {kind: getattr(executor, f"_{kind}s", None) for kind in ("controlnet", "ip_adapter")}
    lora = executor._adapters
    return {"lora": sorted(lora.adapters) if lora is not None else [],
            **{kind: sorted(s.budget.sizes) if s is not None else [] for kind, s in stores.items()},
            "held": sorted(n for s in stores.values() if s is not None for n in s.budget.in_use()),
            "fixed_rows": getattr(executor.pipeline.networks, "fixed_rows", None)}


_RANK0_LOADS: dict = {}  # LoRA name -> rank 0's (file, key) of the load this rank holds (one executor per worker)


def _sync_loras(executor, wanted: dict) -> None:
    """Load and unload LoRA adapters so that this rank holds what rank 0 holds ({name: (file, rank 0's key of its
    load)}): an adapter rank 0 loaded again (a new file under the old name) is loaded again here. One that cannot
    load here (its file gone from the folder, a read error) is left out: a request naming it fails in this rank's
    prepare, which fails that request alone on rank 0 too."""
    store = executor.adapters()
    loads = _RANK0_LOADS
    for name in [n for n in store.adapters if loads.get(n) != wanted.get(n)]:
        store.delete(name)
        loads.pop(name, None)
    for name, (file, key) in wanted.items():
        if name in store.adapters:
            continue
        try:
            if file is None:
                raise FileNotFoundError("its file is no longer in the adapter folder")
            store.load(name, file)
            loads[name] = (file, key)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("rank could not load LoRA adapter %r that rank 0 holds: %s", name, exc)


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:  # noqa: BLE001
        return False


def _fatal(conn, message: str) -> None:
    log.critical("%s", message)
    try:
        conn.send(("fatal", message))
        conn.close()
    except (OSError, EOFError):
        pass
    sys.stderr.flush()
    os._exit(1)

