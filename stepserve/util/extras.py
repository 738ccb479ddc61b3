"""The package extras (pyproject.toml's optional dependencies) a feature needs, checked before it is used: a
missing one is a one-line error naming the pip command, not a traceback from deep inside the feature."""

from __future__ import annotations

import importlib.util


class MissingExtraError(ValueError):
    """A feature's extra is not installed; the message names what needs it and how to install it."""


def missing_modules(*modules: str) -> list[str]:
    """The modules of `modules` that cannot be imported here (looked up, not imported)."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(module)
    return absent


def install_hint(extra: str) -> str:
    return f"pip install 'stepserve[{extra}]'"


def require_extra(extra: str, what: str, *modules: str) -> None:
    """Raise MissingExtraError when any of `modules` (from the `extra` extra) is missing; `what` needs them."""
    absent = missing_modules(*modules)
    if absent:
        raise MissingExtraError(f"{what} needs the {extra!r} extra: {install_hint(extra)} "
                                f"({', '.join(absent)} not installed)")
