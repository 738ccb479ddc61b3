"""The package's layers, held by its import graph: every import (at the top of a module or inside a function)
goes down the layers or stays in its own, no modules import each other in a circle, and the policies and the fleet's
routers reach no torch and no clock through anything they import.

The graph is read from the source (ast), so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import stepserve

ROOT = Path(stepserve.__file__).parent

# Top to bottom: a package may import from its own layer and the layers below it, never from one above.
LAYERS = (
    ("", "cli", "commands"),  # the package's face (stepserve/__init__.py) and the command line
    ("server", "bench", "sim", "deploy", "training", "tiny"),  # front ends, the bench, the simulator, exporters
    ("api", "jobs"),  # the offline API and the jobs that run on an engine
    ("engine",),  # the core loop and its async front end
    ("profiling",),  # measuring the executor at start-up
    ("executor", "scheduling", "parallel"),  # how a step runs (on one device or split over ranks); which rows run it
    ("pipelines", "backends", "fleet"),  # families, how networks run; the fleet's routers and autoscaling
    ("costs", "store"),  # cost curves; the state that outlives a request
    ("request", "sampling"),  # the request's types and validation; the samplers
    # the per-row features: a request is validated against their specs; their per-row code is reached from the
    # executor and the families above
    ("caching", "controls", "ipadapter", "lora", "addons"),
    ("capabilities",),  # what each family serves, declared once (plain data, read by every layer above)
    ("util", "version", "models"),
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}
PURE = ("scheduling", "fleet")  # policies and routers: pure functions of what they are given
IMPURE = ("torch", "time", "datetime", "asyncio", "threading")


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        package = path.name == "__init__.py"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = _modules()


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(the stepserve modules `name` imports, the top-level names of everything else it imports)."""
    path, package = MODULES[name]
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "stepserve":
                theirs.add(target.split(".")[0])
                continue
            while target not in MODULES:  # `from .x import name`: the module is x (or x's package)
                target = target.rpartition(".")[0]
            if target != name:
                ours.add(target)
    return ours, theirs


GRAPH = {name: _imports(name) for name in MODULES}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES}
    assert packages <= set(LAYER_OF), f"packages without a layer in LAYERS: {sorted(packages - set(LAYER_OF))}"


def test_no_import_runs_up_a_layer():
    upward = sorted(f"{a} imports {b}" for a, (ours, _) in GRAPH.items() for b in ours
                    if _package(b) and LAYER_OF[_package(b)] < LAYER_OF[_package(a)])
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert not _cycles({m: ours for m, (ours, _) in GRAPH.items()})
    packages = defaultdict(set)
    for a, (ours, _) in GRAPH.items():
        for b in ours:
            if _package(a) != _package(b) and _package(a) and _package(b):
                packages[_package(a)].add(_package(b))
    assert not _cycles(dict(packages))


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_policies_and_routers_reach_no_torch_and_no_clock():
    for pure in PURE:
        seen, todo = set(), [m for m in MODULES if _package(m) == pure]
        while todo:
            module = todo.pop()
            if module in seen or module == "stepserve":  # the package's face is not what a policy imports
                continue
            seen.add(module)
            ours, theirs = GRAPH[module]
            bad = theirs.intersection(IMPURE)
            assert not bad, f"{pure}: {module} imports {sorted(bad)}"
            todo.extend(ours)
