"""`serve`'s flags for several models: `--model [NAME=]PATH` repeated, `--models-dir DIR`, `--models FILE` (TOML),
`--default-model NAME`, `--device-memory-mb`, `--host-memory-mb`; and the ModelSpecs they give.

Every per-model setting that may differ is a key of a model's table in the TOML file, named as its flag (without
the dashes; `-` or `_` alike): what it does not give comes from the command line. For example:

    default = "draft"                 # the model of requests without "model" (else the first)
    [models.draft]
    path = "/models/sdxl-turbo"
    dtype = "float16"
    served-model-name = ["dall-e-2"]  # other names clients may send
    weight = 1                        # its share of the device when several models have work
    [models.final]
    path = "/models/flux-dev"
    lora-dir = "/loras/flux"
    cache = "fbcache"
    load = "first-use"                # or "start" (the default for models named here and by --model)
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import tomllib
from pathlib import Path

from ..server.models import ModelSpec
from ..server.startup import StartupError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")
# TOML keys -> the attribute of the parsed flags they set (a model's own setting)
PER_MODEL = {"path": "model", "model": "model", "config": "config", "transformer": "transformer", "unet": "unet",
             "dtype": "dtype", "quantize": "quantize", "quantize_text": "quantize_text", "cache": "cache",
             "lora_dir": "lora_dir", "lora_memory_mb": "lora_memory_mb", "controlnet_dir": "controlnet_dir",
             "controlnet_memory_mb": "controlnet_memory_mb", "ip_adapter_dir": "ip_adapter_dir",
             "ip_adapter_memory_mb": "ip_adapter_memory_mb", "latency_model": "latency_model",
             "strategy": "strategy", "max_batch_size": "max_batch_size"}
OWN = ("served_model_name", "weight", "load")  # read here, not flags


def add_models_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every sub-folder of DIR (a diffusers folder) as a model named by the folder, loaded "
                        "on its first request")
    p.add_argument("--models", default=None, metavar="FILE",
                   help="a TOML file of models, each with its own settings named as the flags (path, dtype, "
                        "quantize, lora-dir, controlnet-dir, ip-adapter-dir, cache, latency-model, ...), its "
                        "served-model-name list, its weight on the device and load = start|first-use (docs/MODELS.md)")
    p.add_argument("--default-model", default=None, metavar="NAME",
                   help="with several models: the one requests without \"model\" get (default: the first given)")
    p.add_argument("--device-memory-mb", type=_mb, default=None, metavar="MB",
                   help="with several models: device memory for all models together; an idle model moves to host "
                        "memory (least recently used first) when another needs the room (default: unbounded)")
    p.add_argument("--host-memory-mb", type=_mb, default=None, metavar="MB",
                   help="with several models: host memory for the models moved off the device; past it the least "
                        "recently used goes back to disk (default: unbounded)")


def _mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB, got {text!r}")
    return value


def several(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a server of several models (else `serve` serves one, as it always has)."""
    given = args.models_given
    return (len(given) > 1 or any(_split(m)[0] is not None for m in given) or args.models_dir is not None
            or args.models is not None or args.device_memory_mb is not None or args.host_memory_mb is not None
            or args.default_model is not None)


def _split(text: str) -> tuple[str | None, str]:
    """'NAME=PATH' -> (NAME, PATH); 'PATH' -> (None, PATH). A NAME has no '/' (a path with '=' stays a path)."""
    name, sep, path = text.partition("=")
    if sep and path and "/" not in name and NAME.match(name):
        return name, path
    return None, text


def default_name(path: str) -> str:
    """A model's name when none is given: its folder's (or file's stem), 'embedded' for the embedded model."""
    p = Path(path.rstrip("/"))
    return p.stem if p.is_file() else (p.name or path)


def model_entries(args: argparse.Namespace) -> tuple[list[tuple[str, dict, bool]], str | None]:
    """[(name, settings, eager)] from --model, --models and --models-dir in that order; and the TOML's default."""
    out: list[tuple[str, dict, bool]] = []
    for given in args.models_given:
        name, path = _split(given)
        out.append((name or default_name(path), {"model": path}, True))
    default = None
    if args.models is not None:
        entries, default = _read_toml(args.models)
        out += entries
    if args.models_dir is not None:
        folder = Path(args.models_dir)
        if not folder.is_dir():
            raise StartupError(f"--models-dir {args.models_dir}: not a folder")
        found = sorted(d for d in folder.iterdir() if (d / "model_index.json").is_file())
        if not found:
            raise StartupError(f"--models-dir {args.models_dir}: no model folder (with a model_index.json) in it")
        out += [(d.name, {"model": str(d)}, False) for d in found]
    names = [n for n, _, _ in out]
    bad = next((n for n in names if not NAME.match(n)), None)
    if bad is not None:
        raise StartupError(f"model name {bad[:100]!r}: allowed: 1 to 100 letters, digits, '.', '_', ':' or '-', "
                           f"starting with a letter or digit (give NAME=PATH)")
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise StartupError(f"two models are named {twice!r}: give each its own name (--model NAME=PATH)")
    return out, default


def _read_toml(path: str) -> tuple[list[tuple[str, dict, bool]], str | None]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise StartupError(f"--models {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"--models {path}: not valid TOML: {exc}") from None
    extra = set(data) - {"default", "models"}
    if extra or not isinstance(data.get("models"), dict) or not data["models"]:
        raise StartupError(f"--models {path}: allowed: a 'default' name and a [models.NAME] table per model "
                           f"(found {', '.join(sorted(extra)) or 'no [models.NAME] table'})")
    out = []
    for name, table in data["models"].items():
        if not isinstance(table, dict):
            raise StartupError(f"--models {path}: models.{name} must be a table")
        settings = {k.replace("-", "_"): v for k, v in table.items()}
        unknown = sorted(set(settings) - set(PER_MODEL) - set(OWN))
        if unknown:
            raise StartupError(f"--models {path}: models.{name}: unknown setting(s) {', '.join(unknown)}; allowed: "
                               f"{', '.join(sorted({*PER_MODEL, *OWN} - {'model'}))}")
        if "path" not in settings and "model" not in settings:
            raise StartupError(f"--models {path}: models.{name} has no path")
        if "path" in settings and "model" in settings:
            raise StartupError(f"--models {path}: models.{name} gives both path and model: give one (path)")
        load = settings.pop("load", "start")
        if load not in ("start", "first-use"):
            raise StartupError(f"--models {path}: models.{name}.load must be 'start' or 'first-use', got {load!r}")
        out.append((name, settings, load == "start"))
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise StartupError(f"--models {path}: default must be a model's name")
    return out, default


def _checked(parser: argparse.ArgumentParser, model: str, key: str, dest: str, value):
    """A TOML setting as its flag would take it: its type's conversion and its choices, or one line."""
    action = next((a for a in parser._actions if a.dest == dest), None)
    where = f"model {model}: {key.replace('_', '-')}"
    if action is None or dest == "model":
        if not isinstance(value, str):
            raise StartupError(f"{where} must be a string")
        return value
    if action.nargs == 0:  # a switch (--quantize-text)
        if not isinstance(value, bool):
            raise StartupError(f"{where} must be true or false")
        return value
    if isinstance(value, (dict, list)) or value is None:
        raise StartupError(f"{where} must be a single value, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise StartupError(f"{where}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise StartupError(f"{where}: {converted!r} is not allowed; allowed: {', '.join(map(str, action.choices))}")
    return converted


def model_specs(args: argparse.Namespace, config_of, parser: argparse.ArgumentParser) -> tuple[list[ModelSpec], str]:
    """The ModelSpecs the flags give, and the default model's name. `config_of(args)`: the EngineConfig of one
    model's flags (serve's own, so every check a single model gets runs for each); `parser`: serve's, whose flags
    check each TOML setting as they check the command line."""
    entries, toml_default = model_entries(args)
    if not entries:
        raise StartupError("no model to serve: give --model, --models or --models-dir")
    if any((getattr(args, f, 1) or 1) > 1 for f in ("ulysses_degree", "ring_degree", "tensor_parallel_size")) or \
            getattr(args, "cfg_parallel", False):
        raise StartupError("several models with a degree (--ulysses-degree, --cfg-parallel, ...): allowed: one "
                           "model per server when it is split over several devices")
    specs = []
    for name, settings, eager in entries:
        own = copy.copy(args)
        for key, value in settings.items():
            if key in PER_MODEL:
                setattr(own, PER_MODEL[key], _checked(parser, name, key, PER_MODEL[key], value))
        weight = settings.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight > 0 and
                                                                                     math.isfinite(weight)):
            raise StartupError(f"model {name}: weight must be a positive number, got {weight!r}")
        aliases = settings.get("served_model_name", ())
        aliases = (aliases,) if isinstance(aliases, str) else tuple(aliases)
        try:
            config = config_of(own)
        except StartupError as exc:
            raise StartupError(f"model {name}: {exc}") from None
        specs.append(ModelSpec(name, config, aliases, float(weight), eager))
    default = args.default_model or toml_default or specs[0].name
    if default not in [s.name for s in specs]:
        raise StartupError(f"--default-model {default!r} is not one of the models served: "
                           f"{', '.join(s.name for s in specs)}")
    return specs, default
