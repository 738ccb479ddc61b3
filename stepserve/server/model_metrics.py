"""/metrics of a server of several models: every loaded model's own series (each app keeps its own registry,
metrics.py) with a `model` label, one family at a time as the text format requires, then the shared device's
counters per model: where it is, its steps and their device time, its moves and loads and what they took."""

from __future__ import annotations

from prometheus_client import generate_latest

from ..scheduling.residency import PLACES


def _label(line: str, model: str) -> str:
    """One sample line with model="..." added to its labels."""
    name, _, rest = line.partition(" ")
    value = f'model="{_escape(model)}"'
    if "{" in name:  # name{a="b"} value: labels may hold spaces, so split at the closing brace instead
        head, _, tail = line.partition("{")
        return f"{head}{{{value},{tail}"
    return f"{name}{{{value}}} {rest}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merged(outputs: list[tuple[str, bytes]]) -> list[str]:
    """[(model, one registry's text)] -> one exposition: each family's HELP and TYPE once, then its samples of
    every model."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for model, text in outputs:
        family = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if family not in families:
                    families[family] = []
                    samples[family] = []
                if line not in families[family]:
                    families[family].append(line)
            elif line and family is not None:
                samples[family].append(_label(line, model))
    return [line for f in families for line in (*families[f], *samples[f])]


def render_all(models) -> bytes:
    loaded = [e for e in models.entries.values() if e.app is not None]
    lines = merged([(e.name, generate_latest(e.app.state.server.metrics.registry)) for e in loaded])
    described = {e.name: models.device.describe(e.name) for e in models.entries.values()}
    lines += ["# HELP stepserve_model_place Where each model is (1 for its place: device, host or disk)",
              "# TYPE stepserve_model_place gauge"]
    for name, d in described.items():
        lines += [f'stepserve_model_place{{model="{_escape(name)}",place="{p}"}} {int(d["place"] == p)}'
                  for p in PLACES]
    counters = (("stepserve_model_device_seconds", "Device time of each model's steps", "device_s"),
                ("stepserve_model_steps", "Steps each model ran on the shared device", "steps"),
                ("stepserve_model_device_wait_seconds", "Time each model's steps waited for the device", "wait_s"))
    for metric, text, key in counters:
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}_total{{model="{_escape(n)}"}} {d.get(key, 0)}' for n, d in described.items()]
    for metric, text, key in (("stepserve_model_moves", "Moves of each model to a place (device: back from host "
                                                        "memory; disk: dropped)", "moves"),
                              ("stepserve_model_move_seconds", "Seconds those moves took", "move_s")):
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}_total{{model="{_escape(n)}",place="{p}"}} {d.get(key, {}).get(p, 0)}'
                  for n, d in described.items() for p in PLACES]
    lines += ["# HELP stepserve_model_loads Loads of each model from disk", "# TYPE stepserve_model_loads counter"]
    lines += [f'stepserve_model_loads_total{{model="{_escape(e.name)}"}} {e.loads}' for e in models.entries.values()]
    lines += ["# HELP stepserve_model_load_seconds The last load of each model from disk",
              "# TYPE stepserve_model_load_seconds gauge"]
    lines += [f'stepserve_model_load_seconds{{model="{_escape(e.name)}"}} {e.last_load_s or 0}'
              for e in models.entries.values()]
    return ("\n".join(lines) + "\n").encode()
