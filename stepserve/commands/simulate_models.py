"""`stepserve simulate --latency-model NAME=FILE ...`: several models on every simulated replica (stepserve/sim/device.py),
their engines sharing the replica's device step by step (scheduling.device_share), taken out of the command line
before the bench parser reads the rest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EPILOG = """several models (simulate only; docs/SCALING.md, "Several models on a simulated replica"):
  --latency-model NAME=FILE  repeat to serve several models on every replica, each engine charging its own latency
                        model; the first is the default for requests that name none. A mix's `model` field (or a
                        trace's `model` column) picks each request's model; a name not given here is an error
  --model-weight NAME=W  the model's weight in the device share (default 1): while every model has work, each gets
                        device time in proportion to its weight
"""


class ModelsUsageError(ValueError):
    pass


@dataclass
class ModelFlags:
    paths: dict[str, str] = field(default_factory=dict)  # name -> latency model file, in the order given
    weights: dict[str, float] = field(default_factory=dict)


def split_models(argv: list[str]) -> tuple[list[str], ModelFlags | None]:
    """(the other flags, with one plain --latency-model FILE: the default model's; the models given) or
    (argv unchanged, None) when no --latency-model names a model. A bad value raises ModelsUsageError (one line)."""
    rest, plain, flags = [], [], ModelFlags()
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = next((f for f in ("--latency-model", "--model-weight") if arg == f or arg.startswith(f + "=")), None)
        if name is None:
            rest.append(arg)
            i += 1
            continue
        if arg == name:
            if i + 1 >= len(argv):
                raise ModelsUsageError(f"{name}: expected a value")
            value, i = argv[i + 1], i + 2
        else:
            value, i = arg[len(name) + 1:], i + 1
        key, sep, item = value.partition("=")
        if name == "--model-weight":
            flags.weights[_name(key, sep, item, name, "NAME=W")] = _weight(item)
        elif sep:
            model = _name(key, sep, item, name, "NAME=FILE")
            if model in flags.paths:
                raise ModelsUsageError(f"--latency-model: model {model!r} is given twice")
            flags.paths[model] = item
        else:
            plain.append(value)
    if not flags.paths:
        if flags.weights:
            raise ModelsUsageError("--model-weight goes with several models: give --latency-model NAME=FILE for each")
        return [*rest, *(a for p in plain for a in ("--latency-model", p))], None
    if plain:
        raise ModelsUsageError(f"--latency-model {plain[0]}: with several models every one is NAME=FILE")
    unknown = [m for m in flags.weights if m not in flags.paths]
    if unknown:
        raise ModelsUsageError(f"--model-weight: no model {unknown[0]!r}; the models: {', '.join(flags.paths)}")
    return [*rest, "--latency-model", next(iter(flags.paths.values()))], flags


def _name(key: str, sep: str, item: str, flag: str, shape: str) -> str:
    if not sep or not key or not item:
        raise ModelsUsageError(f"{flag}: expected {shape}, got {key + sep + item!r}")
    return key


def _weight(text: str) -> float:
    try:
        w = float(text)
    except ValueError:
        w = math.nan
    if not (math.isfinite(w) and w > 0):
        raise ModelsUsageError(f"--model-weight: the weight must be a positive number, got {text!r}")
    return w
