"""AddonBudget.follow, a worker rank's store keeping what rank 0 keeps: it unloads what `keep` does not name, except
what its own requests hold, and a shared part only once no add-on left needs it; no eviction is counted."""

from stepserve.addons.store import AddonBudget
from stepserve.ipadapter.store import KIND


class Request:
    is_finished = False


def test_follow_unloads_what_rank_0_dropped_but_not_what_is_held_here():
    unloaded = []
    s = AddonBudget(KIND, unloaded.append, None)  # a worker's store: no bound of its own
    s.needs = {"face": frozenset({"encoder"}), "style": frozenset({"encoder"}), "other": frozenset({"enc2"})}
    for name, size in (("face", 10), ("encoder", 50), ("style", 10), ("other", 10), ("enc2", 50)):
        s.reserve(name, size)
        s.settle(name, size)
    held = Request()
    s.hold(held, ["style"])
    s.follow({"face", "encoder"})  # rank 0 keeps face (and its encoder)
    assert sorted(s.sizes) == ["encoder", "face", "style"] and sorted(unloaded) == ["enc2", "other"]
    assert unloaded.index("other") < unloaded.index("enc2")  # a part goes after its last user
    held.is_finished = True
    s.follow(set())
    assert s.sizes == {} and unloaded[-1] == "encoder" and s.evictions == 0
