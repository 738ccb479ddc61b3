"""The shared device of a server of several models (engine/device.py) and its memory policy
(scheduling/residency.py): one step at a time, picked by the device policy; idle models move out to host memory
least recently used first, never one with requests in flight; host memory over its budget sends its least recently
used idle model to disk."""

import threading

import pytest

from stepserve.engine.device import SharedDevice
from stepserve.scheduling.device_share import DeviceShare
from stepserve.scheduling.residency import DEVICE, DISK, HOST, Placed, make_room


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 0.001  # every look at the clock is later: "least recently used" is then a strict order
        return self.t


def test_make_room_moves_idle_models_least_recently_used_first():
    models = [Placed("a", DEVICE, 4, last_used=3.0), Placed("b", DEVICE, 4, last_used=1.0),
              Placed("c", DEVICE, 4, last_used=2.0, busy=True), Placed("d", HOST, 4, last_used=0.0)]
    assert make_room(models, DEVICE, 4, budget=16) == []
    assert make_room(models, DEVICE, 4, budget=12) == ["b"]  # not c (busy), though older than a
    assert make_room(models, DEVICE, 8, budget=12) == ["b", "a"]
    assert make_room(models, DEVICE, 8, budget=12, keep="a") is None  # only b may move: not enough
    assert make_room(models, DEVICE, 100, budget=None) == []


class Model:
    """A model as the device sees it: where its mover put it, whether it is busy."""

    def __init__(self, device: SharedDevice, name: str, nbytes: int, busy: bool = False) -> None:
        self.name, self.place, self.busy, self.moves = name, DEVICE, busy, []
        device.add(name, nbytes, self.move, lambda: self.busy)

    def move(self, where: str) -> None:
        self.place = where
        self.moves.append(where)


def test_a_model_moves_back_in_its_turn_and_the_idle_least_recently_used_makes_room():
    gone = []
    device = SharedDevice(DeviceShare(), device_bytes=8, host_bytes=None, to_disk=gone.append, clock=FakeClock())
    a, b = Model(device, "a", 4), Model(device, "b", 4)
    assert device.reserve("c", 4)  # a is the least recently used: it moves to host memory
    c = Model(device, "c", 4)
    assert (a.place, b.place, c.place) == (HOST, DEVICE, DEVICE)
    b.busy = True  # b has requests in flight: c, not b, makes room for a
    with device.turn("a", None) as took:
        assert a.place == DEVICE
        took(0.01)
    assert (a.place, b.place, c.place) == (DEVICE, DEVICE, HOST)
    assert device.describe("a")["moves"] == {DEVICE: 1, HOST: 1} and device.describe("a")["steps"] == 1
    assert gone == []


def test_no_room_for_a_load_while_every_model_is_busy():
    device = SharedDevice(DeviceShare(), device_bytes=8, clock=FakeClock())
    Model(device, "a", 4, busy=True), Model(device, "b", 4, busy=True)
    assert not device.reserve("c", 4)
    assert device.describe("a")["place"] == DEVICE and device.describe("b")["place"] == DEVICE


def test_host_memory_over_its_budget_sends_its_least_recently_used_idle_model_to_disk():
    gone = []
    device = SharedDevice(DeviceShare(), device_bytes=4, host_bytes=4, to_disk=gone.append, clock=FakeClock())
    a = Model(device, "a", 4)
    assert device.reserve("b", 4)  # a -> host
    b = Model(device, "b", 4)
    assert device.reserve("c", 4)  # b -> host; host holds 8 > 4: a (older) -> disk
    assert (a.place, b.place) == (HOST, HOST) and device.describe("a")["place"] == DISK and gone == ["a"]


def test_one_step_at_a_time_in_the_policys_order():
    """Two engines wait while a third holds the device; on release the policy picks (here: the earlier deadline),
    and no two steps ever overlap."""
    device = SharedDevice(DeviceShare(), clock=FakeClock())
    for name in "xyz":
        Model(device, name, 1)
    order, inside, overlap = [], [0], []
    release = threading.Event()

    def step(name: str, deadline, hold: bool = False) -> None:
        with device.turn(name, deadline) as took:
            inside[0] += 1
            overlap.append(inside[0] > 1)
            order.append(name)
            if hold:
                release.wait(60)
            inside[0] -= 1
            took(0.01)

    first = threading.Thread(target=step, args=("x", None, True))
    first.start()
    while device.holder != "x":
        pass
    late = threading.Thread(target=step, args=("y", 100.0))
    soon = threading.Thread(target=step, args=("z", 1.0))
    late.start(), soon.start()
    while len(device._bids) < 2:  # both bids are in before the device frees
        pass
    release.set()
    for t in (first, late, soon):
        t.join(60)
    assert order == ["x", "z", "y"] and not any(overlap)


def test_a_model_larger_than_the_device_never_loads():
    from stepserve.scheduling.residency import too_large

    assert too_large(10, 8) and not too_large(8, 8) and not too_large(10, None)


@pytest.mark.parametrize("bad", [{"aging_s": 0}, {"borrow_s": -1}, {"weights": {"a": 0}}])
def test_device_policy_settings_are_checked(bad):
    with pytest.raises(ValueError):
        DeviceShare(**bad)


def test_a_load_waiting_for_room_goes_before_the_engines_that_keep_stepping():
    """Two engines step without pause; a load that needs the device between their steps gets it (it used to wait
    for good: the device was always handed to a bidder first)."""
    device = SharedDevice(DeviceShare(), device_bytes=8, clock=FakeClock())
    Model(device, "a", 4), Model(device, "b", 4)
    stop = threading.Event()

    def steps(name: str) -> None:
        again = False
        while not stop.is_set():
            with device.turn(name, None) as took:
                took(0.01, again=True)
                again = True
        if again:
            device.withdraw(name)

    threads = [threading.Thread(target=steps, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    while device.models["a"].steps < 5 or device.models["b"].steps < 5:
        pass
    loaded = threading.Thread(target=lambda: device.reserve("c", 0))
    loaded.start()
    loaded.join(60)
    stop.set()
    for t in threads:
        t.join(60)
    assert not loaded.is_alive() and not any(t.is_alive() for t in threads)


def test_busy_engines_bidding_at_their_release_share_the_device_by_weight():
    """Each engine bids for its next step as its step ends, so the policy chooses between it and the one waiting
    (without that two busy engines merely alternate): at weights 1:3 and equal steps, b runs three steps to a's
    one."""
    device = SharedDevice(DeviceShare({"a": 1.0, "b": 3.0}), clock=FakeClock())
    Model(device, "a", 1), Model(device, "b", 1)
    order, lock, count = [], threading.Lock(), [0]

    def steps(name: str) -> None:
        while True:
            with device.turn(name, None) as took:
                while name == "a" and not order and "b" not in device._bids:  # a's first step: until b bids
                    pass
                with lock:
                    count[0] += 1
                    order.append(name)
                    last = count[0] >= 200
                took(0.01, again=not last)
            if last:
                device.withdraw(name)
                return

    threads = [threading.Thread(target=steps, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    middle = order[:180]  # both bidding throughout
    assert 0.2 <= middle.count("a") / len(middle) <= 0.3, middle.count("a")


def test_a_model_that_cannot_move_out_stays_whole_and_the_step_goes_on():
    device = SharedDevice(DeviceShare(), device_bytes=4, clock=FakeClock())
    a = Model(device, "a", 4)
    b_moves = []

    def fails(where: str) -> None:
        b_moves.append(where)
        if where == HOST:
            raise RuntimeError("out of memory")

    device.add("b", 4, fails, lambda: False)  # over the budget until a moves
    a.place = HOST
    device.models["a"].place = HOST
    with device.turn("a", None) as took:  # room for a: b should move out and cannot
        took(0.01)
    assert b_moves[:2] == [HOST, DEVICE]  # tried, then put back whole
    assert device.describe("b")["place"] == DEVICE and a.place == DEVICE
