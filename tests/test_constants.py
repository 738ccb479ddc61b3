"""Each shared constant has one home; the places that offer or check it agree with that home."""

from __future__ import annotations

from stepserve import scheduling
from stepserve.engine import loading
from stepserve.commands import bench as bench_cli
from stepserve.bench.targets import Contender
from stepserve.commands import serve as server_cli


def _choices(parser, dest: str):
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_server_cli_offers_exactly_the_engine_strategies_devices_and_dtypes():
    parser = server_cli.build_parser()
    assert tuple(_choices(parser, "strategy")) == scheduling.STRATEGIES
    assert tuple(_choices(parser, "device")) == loading.DEVICES
    assert tuple(_choices(parser, "dtype")) == loading.DTYPES
    assert parser.get_default("max_queue_delay_ms") == scheduling.DEFAULT_MAX_QUEUE_DELAY_MS


def test_bench_cli_defaults_to_every_strategy_and_names_the_devices():
    parser = bench_cli.build_parser()
    assert parser.get_default("strategies") is None
    assert [c.strategy for c in bench_cli.config_from_args(["--model", "fake"]).contenders] == [
        s for s in scheduling.STRATEGIES for _ in (range(3) if s == "dynamic" else range(1))]  # 3 dynamic delays
    assert tuple(_choices(parser, "device")) == loading.DEVICES  # the same flags as serve (commands/flags.py)
    assert tuple(_choices(parser, "dtype")) == loading.DTYPES
    assert Contender("dynamic").max_queue_delay_ms == scheduling.DEFAULT_MAX_QUEUE_DELAY_MS


def test_one_sampler_to_scheduler_map():
    import stepserve.sampling as sampling
    from stepserve.request import types
    from stepserve.pipelines import diffusers_sd
    from tiny_sd import SCHEDULER_CLASS

    assert types.SCHEDULER_CLASSES == SCHEDULER_CLASS  # the tests' independent statement of the map
    assert sampling.SAMPLER_NAMES is types.SAMPLER_NAMES == tuple(types.SCHEDULER_CLASSES)
    assert {cls: diffusers_sd._SCHEDULER_TO_SAMPLER[cls] for cls in SCHEDULER_CLASS.values()} == {
        cls: name for name, cls in SCHEDULER_CLASS.items()}


def test_one_max_seed_the_one_the_http_docs_state():
    import re
    from pathlib import Path

    from stepserve.request import validation
    from stepserve.bench import workload
    from stepserve.server import schemas

    docs = (Path(__file__).resolve().parents[1] / "docs" / "HTTP_API.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `seed`"))
    base, exp, minus = map(int, re.search(r"0\.\.(\d+)\^(\d+)-(\d+)", row).groups())
    assert base**exp - minus == validation.MAX_SEED
    for module in (schemas, workload):  # whoever names MAX_SEED uses the one from validation
        assert getattr(module, "MAX_SEED", validation.MAX_SEED) is validation.MAX_SEED, module.__name__


def test_http_seed_bound_is_max_seed():
    import json

    import pytest

    from stepserve.server.errors import APIError
    from stepserve.server.schemas import ServerLimits, parse_body
    from stepserve.request.validation import MAX_SEED

    def body(**fields) -> bytes:
        return json.dumps({"prompt": "a", **fields}).encode()

    limits = ServerLimits()
    assert parse_body(body(seed=MAX_SEED), limits).seed == MAX_SEED
    with pytest.raises(APIError, match=str(MAX_SEED)):
        parse_body(body(seed=MAX_SEED + 1), limits)
    assert parse_body(body(seed=MAX_SEED - 1, n=2), limits).seed == MAX_SEED - 1  # image i uses seed + i
    with pytest.raises(APIError, match="seed"):
        parse_body(body(seed=MAX_SEED, n=2), limits)


def test_drawn_seeds_stay_below_one_limit():
    import random

    from stepserve.bench.workload import Mix
    from stepserve.request.validation import DRAWN_SEED_LIMIT, MAX_SEED, draw_seed

    assert DRAWN_SEED_LIMIT - 1 <= MAX_SEED
    assert all(0 <= draw_seed() < DRAWN_SEED_LIMIT for _ in range(100))
    rng = random.Random(0)
    assert all(0 <= Mix().draw(rng).seed < DRAWN_SEED_LIMIT for _ in range(100))


def test_one_size_parser_width_first():
    import random

    import pytest

    from stepserve.bench import workload
    from stepserve.server import schemas
    from stepserve.request.validation import ValidationError, parse_size

    size = parse_size("48x32")
    assert size == (48, 32) and (size.width, size.height) == (48, 32)
    assert schemas.request_size("48x32") == (48, 32) and schemas.request_size("auto") == (None, None)
    assert not hasattr(workload, "parse_size") or workload.parse_size is parse_size
    spec = workload.Mix.from_dict({"size": ["48x32"]}).draw(random.Random(0))
    assert (spec.width, spec.height) == (48, 32) and spec.to_http()["size"] == "48x32"
    assert workload.Mix.from_dict({"size": ["48x32", "16x16"]}).heaviest(8).to_http()["size"] == "48x32"
    for bad in ("48", "48x", "x32", "48X32", " 48x32", "-4x4", "4x4x4", 48):
        with pytest.raises(ValidationError, match="size"):
            parse_size(bad)


def test_one_list_of_digit_prompts():
    from stepserve.commands import grid
    from stepserve.bench.workload import Mix
    from stepserve.util.digits import DIGIT_PROMPTS, DIGIT_WORDS
    from stepserve.training import data

    assert len(DIGIT_WORDS) == 10 and DIGIT_PROMPTS[7] == "a handwritten seven"
    assert data.DIGIT_WORDS is DIGIT_WORDS and grid.DIGIT_PROMPTS is DIGIT_PROMPTS
    assert tuple(Mix().prompts.values) == DIGIT_PROMPTS
