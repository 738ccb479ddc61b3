"""Model affinity between replicas that each serve several models: a request naming its model prefers the replicas
holding it on their device, then in host memory, then any (fleet/routers.py, model_tiers)."""

from stepserve.fleet.routers import best_tier, model_tiers


def test_device_first_then_host_memory_then_anywhere():
    places = [{"sd": "disk", "flux": "device"}, {"sd": "host", "flux": "host"}, {"sd": "device", "flux": "disk"},
              None]  # the last published nothing yet
    assert model_tiers(places, "sd") == [(2, 1), (1, 0), (0, 0), (2, 0)]
    assert model_tiers(places, "flux") == [(0, 0), (1, 0), (2, 1), (2, 0)]
    assert best_tier(model_tiers(places, "sd")) == [2]
    moved = [{"sd": "host"}, {"sd": "host"}, {"sd": "disk"}]
    assert best_tier(model_tiers(moved, "sd")) == [0, 1]  # none on a device: those that move it, not load it


def test_a_model_no_replica_holds_goes_where_the_fewest_models_are_on_the_device():
    """Two models, neither loaded anywhere yet, spread over two replicas instead of taking turns on one."""
    places = [{"sd": "disk", "flux": "device", "flux-alias": "device"}, {"sd": "disk", "flux": "disk"}]
    assert best_tier(model_tiers(places, "sd")) == [1]
    assert best_tier(model_tiers([{"sd": "host", "xl": "device"}, {"sd": "host", "xl": "host"}], "sd")) == [1]


def test_a_name_no_replica_serves_as_a_model_gives_no_affinity():
    """The header then names a LoRA adapter (or nothing the replicas know): the adapter affinity applies."""
    places = [{"sd": "device"}, {"sd": "disk"}]
    assert model_tiers(places, "ink-lora") is None
    assert model_tiers(places, "") is None
    assert model_tiers([None, None], "sd") is None  # replicas of one model publish no places
    assert best_tier([(2, 0), (2, 0)]) == [0, 1]
