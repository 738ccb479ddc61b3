"""How a step runs its ControlNets: each one in use runs once, on the rows that use it at this step (guided rows
twice, as diffusers' pipeline runs them); a row outside its window and a batch without controls run none; rows
that cache steps share the forward with control rows; the ControlNet memory unloads the least recently used."""

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import pixels

from stepserve import Engine
from stepserve.controls.errors import ControlNetTooLargeError

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


def counting(engine, monkeypatch):
    """Per ControlNet name, the row count of every forward it ran."""
    store = engine.executor.controlnets()
    seen: dict[str, list[int]] = {}
    ensure = store.ensure

    def counted(net, name):
        return lambda sample, *a, **k: (seen.setdefault(name, []).append(sample.shape[0]), net(sample, *a, **k))[1]

    monkeypatch.setattr(store, "ensure",
                        lambda names, **kw: {n: counted(m, n) for n, m in ensure(names, **kw).items()})
    return seen


def test_each_controlnet_runs_once_per_step_on_its_rows(tiny_sd_path, folder, monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="static", static_batch_size=4, max_batch_size=4,
                                    controlnet_dir=str(folder))
    seen = counting(engine, monkeypatch)
    reqs = [request(1, ()), request(2, (("pose", 1.0, 0.0, 1.0),)),
            request(3, (("pose", 0.5, 0.0, 1.0), ("depth", 1.0, 0.0, 0.5)), guidance=1.0),
            request(4, (("edge", 1.0, 0.0, 1.0),), guidance=1.0)]
    results = engine.generate(reqs)
    assert all(r.timing.batch_sizes == [4] * 6 for r in results)  # one batch of four, six steps
    # pose: request 2's two rows (guided) and request 3's one; depth: the first half of the schedule only
    assert seen == {"pose": [3] * 6, "depth": [1] * 3, "edge": [1] * 6}
    seen.clear()
    engine.generate([request(5, ()), request(6, (), guidance=1.0)])
    assert seen == {}  # a batch without controls runs no ControlNet


def test_cached_rows_and_control_rows_share_a_forward(tiny_sd_path, folder, monkeypatch):
    """A row that caches steps (deepcache, fbcache) beside rows with controls: each image is its own alone, the
    cached rows still skip work, and a control row is diffusers' image."""
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    controlnet_dir=str(folder))
    reqs = [request(30, (), cache={"policy": "deepcache", "interval": 2}),
            request(31, (("pose", 1.0, 0.0, 1.0),)),
            request(32, (), cache={"policy": "fbcache", "threshold": 0.5}, guidance=1.0),
            request(33, (("depth", 0.8, 0.0, 1.0), ("pose", 0.6, 0.2, 1.0)), guidance=1.0)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(together[0].timing.batch_sizes) == 4
    assert together[0].timing.cached_steps > 0
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
    assert np.abs(pixels(together[3].image) - diffusers_controlnet(tiny_sd_path, folder, reqs[3])).max() <= 1


def test_the_memory_budget_unloads_the_least_recently_used(tiny_sd_path, folder):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", controlnet_dir=str(folder))
    store = engine.executor.controlnets()
    assert store.listing() == [{"name": n, "loaded": False, "bytes": None} for n in ("depth", "edge", "pose")]
    engine.generate([request(40, (("pose", 1.0, 0.0, 1.0),))])
    one = store.loaded["pose"].bytes
    store.budget_bytes = int(2.5 * one)  # room for two
    engine.generate([request(41, (("depth", 1.0, 0.0, 1.0),))])
    engine.generate([request(42, (("pose", 1.0, 0.0, 1.0),))])  # pose used last: depth is the older
    p = request(43, (("edge", 1.0, 0.0, 1.0),))
    got = engine.generate([p])[0]
    assert sorted(store.loaded) == ["edge", "pose"] and store.evictions == 1
    assert np.abs(pixels(got.image) - diffusers_controlnet(tiny_sd_path, folder, p)).max() <= 1
    again = engine.generate([request(41, (("depth", 1.0, 0.0, 1.0),))])[0]  # loads again from its folder
    assert again.ok and "depth" in store.loaded and store.evictions == 2


def test_two_controlnets_that_never_fit_together_fail_that_request_alone(tiny_sd_path, folder):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", controlnet_dir=str(folder))
    store = engine.executor.controlnets()
    engine.generate([request(50, (("pose", 1.0, 0.0, 1.0),))])
    store.budget_bytes = int(1.5 * store.loaded["pose"].bytes)
    both, fine = engine.generate([request(51, (("pose", 1.0, 0.0, 1.0), ("depth", 1.0, 0.0, 1.0))),
                                  request(52, (("pose", 1.0, 0.0, 1.0),))])
    assert not both.ok and "can never be served together" in both.error and "depth" in both.error
    assert isinstance(both.cause, ControlNetTooLargeError)
    assert fine.ok
