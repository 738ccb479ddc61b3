"""Where a server's API key comes from: a flag, a file or the environment (plain functions, no imports).

A key given as `--api-key KEY` is visible to every user of the machine in `ps`; `--api-key-file PATH` and the
STEPSERVE_API_KEY environment variable are not. `stepserve serve` (and its Ray Serve replicas) and the Triton
launcher read it the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV = "STEPSERVE_API_KEY"


def read_key_file(path: str) -> str:
    """The key in a file: its text without surrounding whitespace. ValueError when unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path!r} cannot be read ({exc})") from None
    if not key:
        raise ValueError(f"--api-key-file {path!r} is empty; write the key into it")
    return key


def resolve_api_key(key: str | None = None, key_file: str | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """--api-key, else the contents of --api-key-file, else $STEPSERVE_API_KEY, else None (no key required).
    Raises ValueError when both flags are given or the file is unreadable or empty."""
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key is not None:
        if not key.strip():
            raise ValueError("--api-key is empty")
        return key.strip()
    if key_file is not None:
        return read_key_file(key_file)
    value = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    return value or None
