"""The add-ons' one budgeted store (stepserve/addons/store.py), without any model: what requests in flight hold
is never unloaded, whatever the current call names; nothing is unloaded for an add-on that will not fit; too large
is permanent and remembered until the files change; a shared part counts once and goes with its last user; the
errors are the kind's own, typed as every add-on's."""

from __future__ import annotations

import pickle

import pytest

from stepserve.addons.errors import AddonBudgetError, AddonTooLargeError
from stepserve.addons.store import AddonBudget
from stepserve.controls.errors import ControlNetBudgetError, ControlNetTooLargeError
from stepserve.controls.store import KIND


class Request:
    is_finished = False


def store(budget):
    unloaded = []
    s = AddonBudget(KIND, unloaded.append, budget)
    return s, unloaded


def load(s, name, size, **kw):
    s.reserve(name, size, **kw)
    s.settle(name, size, **kw)


def test_what_a_request_in_flight_holds_is_never_unloaded():
    s, unloaded = store(100)
    load(s, "pose", 60)
    first = Request()
    s.hold(first, ["pose"])
    with pytest.raises(ControlNetBudgetError, match="retry later") as err:
        s.reserve("depth", 60)  # the current call names only depth: pose is still held
    assert isinstance(err.value, AddonBudgetError) and err.value.param == "controls" and unloaded == []
    first.is_finished = True  # the request ended: pose is idle
    load(s, "depth", 60)
    assert unloaded == ["pose"] and set(s.sizes) == {"depth"} and s.evictions == 1


def test_too_large_is_refused_before_anything_is_unloaded_and_remembered():
    s, unloaded = store(100)
    load(s, "pose", 60)
    with pytest.raises(ControlNetTooLargeError, match="larger than the whole ControlNet memory") as err:
        s.reserve("huge", 150, stamp=("huge", 1))
    assert isinstance(err.value, AddonTooLargeError) and unloaded == []
    with pytest.raises(ControlNetTooLargeError):
        s.remembered("huge", ("huge", 1))  # asked again: refused without a look at its files
    s.remembered("huge", ("huge", 2))  # its file changed: looked at again
    with pytest.raises(ControlNetTooLargeError, match="can never be served together"):
        s.reserve("depth", 60, own=["pose"])
    assert pickle.loads(pickle.dumps(err.value)).param == "controls"  # a result crosses processes whole


def test_a_shared_part_counts_once_and_goes_with_its_last_user():
    s, unloaded = store(100)
    s.needs.update(a={"enc"}, b={"enc"}, c={"enc2"})
    s.reserve("a", 50)
    s.settle("a", 10, parts={"enc": 40})
    load(s, "b", 10)  # its part is loaded already: only its own bytes
    assert s.loaded_bytes == 60
    s.reserve("c", 90)  # unloads a and b, then their part
    assert unloaded == ["a", "b", "enc"] and s.evictions == 2
