"""What a client says of its request's work, for a fleet router that routes before reading the body (Ray Serve's
proxy: server/ray/router.py reads them from the request's ASGI scope): `x-stepserve-steps: 50` and
`x-stepserve-size: 1024x1024`. `stepserve bench --target` sends them (work_headers). They steer only the routing:
the replica serves what the body asks, and a header that lies moves one request's price for a stats period.

Pure: no clock, no I/O.
"""

from __future__ import annotations

STEPS_HEADER, SIZE_HEADER = "x-stepserve-steps", "x-stepserve-size"
WORK_HEADERS = (STEPS_HEADER, SIZE_HEADER)
MAX_STEPS, MAX_SIDE = 10_000, 16_384  # a header past these says nothing (the request is judged by its replica)


def work_headers(steps: int | None, width: int | None, height: int | None) -> dict[str, str]:
    """The headers that say a request's steps and size (those given)."""
    headers = {}
    if steps is not None:
        headers[STEPS_HEADER] = str(int(steps))
    if width is not None and height is not None:
        headers[SIZE_HEADER] = f"{int(width)}x{int(height)}"
    return headers


def work_of_headers(headers) -> tuple[int, int]:
    """(steps, pixels) from the x-stepserve-steps and x-stepserve-size headers (e.g. 50 and 1024x1024); 0 for
    each that is missing or not a number in range."""
    steps = pixels = 0
    for key, value in headers:
        key = key.decode("latin-1").lower() if isinstance(key, bytes) else str(key).lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        if key == STEPS_HEADER:
            steps = _count(text, MAX_STEPS)
        elif key == SIZE_HEADER:
            w, _, h = text.lower().partition("x")
            w, h = _count(w, MAX_SIDE), _count(h, MAX_SIDE)
            pixels = w * h
    return steps, pixels


def _count(text: str, most: int) -> int:
    """A whole number from 1 to `most` written in ASCII digits, else 0."""
    text = text.strip()
    if not (0 < len(text) <= 6 and text.isascii() and text.isdigit()):
        return 0
    return int(text) if 0 < int(text) <= most else 0

