"""Each shared constant has one home; the places that offer or check it agree with that home."""

from __future__ import annotations

from stepserve import api, scheduling
from stepserve.bench import cli as bench_cli
from stepserve.bench.targets import Contender
from stepserve.server import cli as server_cli


def _choices(parser, dest: str):
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_server_cli_offers_exactly_the_engine_strategies_devices_and_dtypes():
    parser = server_cli.build_parser()
    assert tuple(_choices(parser, "strategy")) == scheduling.STRATEGIES
    assert tuple(_choices(parser, "device")) == api.DEVICES
    assert tuple(_choices(parser, "dtype")) == api.DTYPES
    assert parser.get_default("max_queue_delay_ms") == scheduling.DEFAULT_MAX_QUEUE_DELAY_MS


def test_bench_cli_defaults_to_every_strategy_and_names_the_devices():
    parser = bench_cli.build_parser()
    assert tuple(parser.get_default("strategies").split(",")) == scheduling.STRATEGIES
    helps = {a.dest: a.help for a in parser._actions}
    assert all(d in helps["device"] for d in api.DEVICES)
    assert all(d in helps["dtype"] for d in api.DTYPES)
    assert Contender("dynamic").max_queue_delay_ms == scheduling.DEFAULT_MAX_QUEUE_DELAY_MS


def test_one_sampler_to_scheduler_map():
    import stepserve.sampling as sampling
    from stepserve import types
    from stepserve.pipelines import diffusers_sd
    from tiny_sd import SCHEDULER_CLASS

    assert types.SCHEDULER_CLASSES == SCHEDULER_CLASS  # the tests' independent statement of the map
    assert sampling.SAMPLER_NAMES is types.SAMPLER_NAMES == tuple(types.SCHEDULER_CLASSES)
    assert {cls: diffusers_sd._SCHEDULER_TO_SAMPLER[cls] for cls in SCHEDULER_CLASS.values()} == {
        cls: name for name, cls in SCHEDULER_CLASS.items()}
