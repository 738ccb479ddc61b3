"""Rank 0's executor for a model split over several ranks: the engine core sees one executor, as with one device.

Each stage sends the other ranks what they need to run it on their mirrors of the same requests (worker.py), then
runs it here; the forward's collectives meet inside. Everything else (the model's info, the add-on stores, previews,
the lock) is rank 0's own executor's. Decoding runs here only: the workers just forget the requests.

Failures: a stage that fails here before any rank has started it fails as on one device (the core isolates the
request). A worker that fails, dies or stops answering makes every later stage raise RanksLost, and the listeners
in `on_failure` hear why at once (the AsyncEngine then fails what is pending and reports itself unhealthy)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..request.types import Request
from .ranks import Ranks

_OWN = frozenset({"local", "ranks", "_live", "_info", "_sent"})


def with_sequence_degree(info, n: int):
    """`info` for a server whose forward splits the image tokens over `n` ranks: requests must divide into them;
    the default width is the next one whose tokens do, where the model's own does not."""
    from ..request.validation import split_tokens

    if n <= 1:
        return info
    width = info.default_width
    while split_tokens(info, width, info.default_height, None) % n and width + info.size_multiple <= info.max_size:
        width += info.size_multiple
    return replace(info, sequence_degree=n, default_width=width)


class ParallelExecutor:
    def __init__(self, local: Any, ranks: Ranks) -> None:
        object.__setattr__(self, "local", local)  # this rank's TorchExecutor, split (local.split)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_live", {})  # request_id -> Request the workers mirror
        object.__setattr__(self, "_info", (None, None))  # (the local ModelInfo, this executor's of it)
        object.__setattr__(self, "_sent", {})  # add-on kind -> what the workers were last told rank 0 holds

    # everything but the stages is the local executor's (model_info, adapters(), controlnets(), lock, pipeline ...)
    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.local, name, value)

    @property
    def model_info(self):
        """The local executor's, with the token split requests must divide into (and a default size that does);
        made again only when the local one changes (it is read for every request)."""
        local = self.local.model_info
        if self._info[0] is not local:
            self._info = (local, with_sequence_degree(local, self.ranks.degrees.sequence))
        return self._info[1]

    @model_info.setter
    def model_info(self, info) -> None:
        self.local.model_info = info

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot run another step (None while they can)."""
        return self.ranks.failure

    @property
    def on_failure(self) -> list:
        return self.ranks.on_failure

    @property
    def degrees(self):
        return self.ranks.degrees

    def prepare(self, requests: list[Request]) -> float:
        with self.local.lock:
            for r in requests:
                self._live[r.request_id] = r
            mirrors = [replace(r, preview_steps=frozenset(), timing=None, latents=None, conditioning=None,
                               sampler_state=None, preview_latents=None, image=None, frames=None, step_cache=None,
                               inpaint=None, controls=None, image_prompt=None, cause=None) for r in requests]
            self.ranks.send(("prepare", mirrors, *self._news()))
            failed: BaseException | None = None
            try:
                seconds = self.local.prepare(requests)
            except Exception as exc:  # noqa: BLE001 - raised below, after the workers answered
                failed = exc
            for reply in self.ranks.replies():
                if reply[0] == "error" and failed is None:
                    failed = reply[1]  # a worker could not prepare what this rank could: the same request fails
            if failed is not None:
                raise failed
            return seconds

    def denoise(self, requests: list[Request]) -> float:
        with self.local.lock:
            self.local._check_adapters(requests)  # a LoRA gone: fails here, before any rank starts the step
            self.ranks.send(("denoise", [(r.request_id, r.step) for r in requests], *self._news()))
            try:
                return self.local.denoise(requests)
            except Exception as exc:  # noqa: BLE001 - the other ranks may be inside the forward: none can go on
                raise self.ranks.step_failed(exc) from exc

    def decode(self, requests: list[Request]) -> float:
        seconds = self.local.decode(requests)
        with self.local.lock:
            for r in requests:
                self._live.pop(r.request_id, None)
            ended, addons = self._news(also=[r.request_id for r in requests])
            if ended or addons is not None:
                self.ranks.send(("ended", ended, addons))
        return seconds

    def preview(self, request: Request):
        return self.local.preview(request)

    def close(self) -> None:
        """Stop the workers and leave torch.distributed (ranks.close), so that this process can start another
        parallel model."""
        self.ranks.close()

    def mirror_fast_path(self, options, max_batch_size: int) -> None:
        """The workers wrap their networks as backends/fast_path.py has wrapped this rank's (--deterministic: each
        CFG half's forward at the same fixed padded shape, so a row's output does not depend on its company)."""
        with self.local.lock:
            self.ranks.send(("fast_path", options, max_batch_size, *self._news()))
            for reply in self.ranks.replies(timeout_s=None):
                if reply[0] == "error":
                    raise ValueError(f"{self.degrees.describe()}: a worker rank could not apply the fast path: "
                                     f"{reply[1]}")

    def workers_state(self) -> list[dict]:
        """What each worker holds now (a check that it follows this rank): {"lora": [names], "controlnet": [names],
        "ip_adapter": [names, shared parts included], "held": [ControlNets and IP-Adapters its mirrors still hold],
        "fixed_rows": the denoiser's fixed batch (--deterministic) or None}."""
        with self.local.lock:
            self.ranks.send(("state", *self._news()))
            return [reply[1] for reply in self.ranks.replies()]

    def _news(self, also: list[str] = ()) -> tuple[list[str], dict | None]:
        """(the requests the workers may forget, what changed in the add-ons loaded here since the last message,
        else None): {"lora": {name: (file, this rank's key of that load)}, "controlnet": names, "ip_adapter":
        names}, each kind only when it changed. A worker loads the LoRA adapters as told and unloads the others; it
        loads ControlNets and IP-Adapters when its requests need them and unloads those this rank has unloaded
        (worker.py), so that its memory follows this rank's budgets."""
        ended = [rid for rid, r in self._live.items() if r.status.finished]
        for rid in ended:
            del self._live[rid]
        news = {}
        store = self.local._adapters
        if store is not None and store.version != self._sent.get("lora"):
            self._sent["lora"] = store.version
            files = store.files()
            # each load's key too: a file deleted and loaded again under its name (new weights) is a new load
            news["lora"] = {n: (store.sources.get(n, files.get(n)), store.keys[n]) for n in store.adapters}
        for kind, store in (("controlnet", self.local._controlnets), ("ip_adapter", self.local._ip_adapters)):
            loaded = None if store is None else frozenset(store.budget.sizes)  # one copy (GIL-atomic for str keys)
            if loaded is not None and loaded != self._sent.get(kind):
                self._sent[kind] = news[kind] = loaded
        return ended + list(also), news or None
