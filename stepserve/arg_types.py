"""argparse value types shared by the command-line modules: each refuses a bad value with a message that says
what is allowed (argparse turns it into `error: argument --flag: expected ..., got '...'`)."""

from __future__ import annotations

import argparse
import math


def int_from(low: int, high: int | None = None):
    """An integer >= `low` (and <= `high` when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    return parse


def float_from(low: float, inclusive: bool, what: str):
    """A finite float above `low` (or at least `low` when inclusive); `what` says what is allowed."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value >= low if inclusive else value > low
        if not ok or math.isinf(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse
