"""The IP-Adapter store's memory: an adapter's size is known from its files before it goes to the device (one
that can never fit is refused without being placed); nothing is unloaded for an adapter that does not fit; the
adapters of requests in flight, or of requests getting their embeddings, are never unloaded; a request whose
adapters together exceed the whole memory is told it can never be served."""

import pytest
import torch

from stepserve.engine.loading import load_executor
from stepserve.ipadapter.parts import IPAdapterBudgetError, IPAdapterTooLargeError
from stepserve.ipadapter.rows import Embedded
from stepserve.ipadapter.store import IPAdapterStore
from stepserve.tiny.ipadapter import build_tiny_ip_adapter


@pytest.fixture(scope="module")
def setup(tiny_sd_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ip_adapters")
    for seed, (name, width) in enumerate((("a", 16), ("b", 16), ("c", 64)), start=1):
        build_tiny_ip_adapter(tiny_sd_path, folder / name, seed=seed, embed_dim=width)
    executor = load_executor(str(tiny_sd_path))
    unbounded = IPAdapterStore(executor.pipeline, folder, executor.lock)
    sizes = {n: unbounded.ensure(n).bytes for n in "abc"}
    assert sizes["a"] == sizes["b"] < sizes["c"]
    return executor, folder, sizes


def store_of(setup, budget):
    executor, folder, _ = setup
    return IPAdapterStore(executor.pipeline, folder, executor.lock, budget_bytes=budget)


class InFlight:
    """A request in flight holding an image prompt of `name`."""

    def __init__(self, name):
        self.image_prompt = (Embedded(name, 1.0, torch.zeros(1, 16)),)


def test_the_size_is_known_before_the_device_and_one_too_large_is_never_placed(setup, monkeypatch):
    sizes = setup[2]
    store = store_of(setup, sizes["a"] // 2)
    placed = []
    place = store._place
    monkeypatch.setattr(store, "_place", lambda name, parts: (placed.append(name), place(name, parts))[1])
    with pytest.raises(IPAdapterTooLargeError, match="larger than the whole IP-Adapter memory"):
        store.ensure("a")
    assert placed == [] and store.loaded == {}
    roomy = store_of(setup, 10 * sizes["c"])
    assert roomy.ensure("c").bytes == sizes["c"]  # the size read from the files is the size placed


def test_nothing_is_unloaded_for_an_adapter_that_does_not_fit(setup):
    sizes = setup[2]
    store = store_of(setup, sizes["a"] + sizes["b"])
    store.ensure("a")
    store.ensure("b")
    busy = InFlight("b")
    store.hold(busy)
    with pytest.raises(IPAdapterBudgetError, match="retry later"):
        store.ensure("c")  # a is idle, but unloading it would not make room beside b
    assert set(store.loaded) == {"a", "b"} and store.evictions == 0
    del busy
    assert store.ensure("c").name == "c" and "c" in store.loaded and store.evictions >= 1  # b idle now


def test_adapters_of_requests_getting_their_embeddings_are_not_unloaded(setup):
    sizes = setup[2]
    store = store_of(setup, sizes["a"])
    store.ensure("a")
    with store.starting(["a"]):
        with pytest.raises(IPAdapterBudgetError):
            store.ensure("b")
        assert set(store.loaded) == {"a"}
    assert store.ensure("b") and set(store.loaded) == {"b"}  # a was idle once its request had its embedding


def test_a_request_whose_adapters_never_fit_together_is_told_so(setup):
    sizes = setup[2]
    store = store_of(setup, sizes["a"] + sizes["b"] // 2)
    store.ensure("a", keep=["a", "b"])
    with pytest.raises(IPAdapterTooLargeError, match="can never be served together"):
        store.ensure("b", keep=["a", "b"])
    assert set(store.loaded) == {"a"}
