"""The adapter folder (--lora-dir): which files are adapters and by what names, which paths a load may use, and
how a path is shown (relative to the folder: the server's own layout is nobody's business). No torch.

An adapter is a *.safetensors file, or a folder holding `pytorch_lora_weights.safetensors` (what diffusers'
`save_lora_weights` writes and `load_lora_weights` reads). In the adapter folder, and in its subfolders, each is
servable by a name: the path relative to the folder without the extension (a diffusers folder: its own path),
'/' read as '.', any other character outside letters, digits, '-', '_' and '.' as '_'. So `ink.safetensors` is
"ink", `styles/ink.safetensors` is "styles.ink" and `styles/ink/pytorch_lora_weights.safetensors` is "styles.ink"
too: where two paths give one name, the shallower (then the first in order) is served.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import LoraError

DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
MAX_NAME = 64
NAME_RULE = f"1-{MAX_NAME} characters of letters, digits, '-', '_' and '.'"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not all(_allowed(c) for c in name):
        raise LoraError(f"name {name!r}: {NAME_RULE}", "name")
    return name


def _allowed(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "-_.")


def name_of(relative: Path) -> str | None:
    """The name an adapter at `relative` (inside the folder) is served by; None where none fits the rule."""
    parts = relative.parent.parts if relative.name == DIFFUSERS_WEIGHTS else (*relative.parent.parts, relative.stem)
    name = ".".join("".join(c if _allowed(c) else "_" for c in part) for part in parts)
    return name if 0 < len(name) <= MAX_NAME else None


def stamp(root: Path | None):
    """Changes when an adapter is added to or removed from the folder or a subfolder (their modification times)."""
    if root is None:
        return None
    try:
        return tuple(os.stat(folder).st_mtime_ns for folder, _, _ in _walk(root))
    except OSError:
        return None


class Watched:
    """A folder's entries by name (`discover(root)`), looked for again only when the folder changed (`stamp`)."""

    def __init__(self, root: Path | None, discover) -> None:
        self.root, self.discover = root, discover
        self._seen: tuple = (object(), {})  # (folder stamp, entries) of the last look

    def files(self) -> dict[str, Path]:
        now = stamp(self.root)
        if self._seen[0] != now or now is None:
            self._seen = (now, self.discover(self.root))
        return self._seen[1]


def _walk(root: Path):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield folder, dirs, files


def discover(root: Path) -> dict[str, Path]:
    """The folder's adapters by name (see the module docstring)."""
    found: list[tuple[int, str, Path]] = []
    for folder, _, files in _walk(root):
        for file in sorted(files):
            if file.endswith(".safetensors") and not file.startswith("."):
                path = Path(folder) / file
                relative = path.relative_to(root)
                name = name_of(relative)
                if name is not None:
                    found.append((len(relative.parts), str(relative), path))
    out: dict[str, Path] = {}
    for _, relative, path in sorted(found):
        out.setdefault(name_of(Path(relative)), path)
    return out


def check_path(root: Path | None, path: object) -> Path:
    """`path` (relative to the folder, or absolute inside it) resolved to an adapter file or diffusers folder;
    LoraError (param "path") for anything a load cannot use."""
    if not isinstance(path, (str, os.PathLike)) or not str(path) or "\0" in str(path):
        raise LoraError(f"path {path!r}: expected a file or folder in the adapter folder (a non-empty path without "
                        f"NUL characters)", "path")
    try:
        given = Path(path)
        resolved = (root / given if root is not None and not given.is_absolute() else given).resolve()
        if root is not None and root != resolved and root not in resolved.parents:
            raise LoraError(f"path {str(path)!r} is outside the adapter folder (--lora-dir); allowed: files in it",
                            "path")
        if resolved.is_dir():
            if not (resolved / DIFFUSERS_WEIGHTS).is_file():
                raise LoraError(f"path {str(path)!r} is a folder without {DIFFUSERS_WEIGHTS}; allowed: a "
                                f".safetensors file, or a folder save_lora_weights wrote", "path")
            return resolved / DIFFUSERS_WEIGHTS
        if not resolved.is_file():
            raise LoraError(f"path {str(path)!r}: no such file", "path")
    except (OSError, ValueError) as exc:
        if isinstance(exc, LoraError):
            raise
        raise LoraError(f"path {str(path)!r} cannot be read: {exc.strerror if isinstance(exc, OSError) else exc}",
                        "path") from None
    return resolved


def shown(root: Path | None, path: Path) -> str:
    """`path` as users see it: relative to the adapter folder (the file's name alone outside it)."""
    if root is not None:
        try:
            return str(path.relative_to(root))
        except ValueError:
            pass
    return path.name if path.name != DIFFUSERS_WEIGHTS else f"{path.parent.name}/{path.name}"


def scrub(message: str, root: Path | None, path: Path) -> str:
    """An error message from a library with the server's absolute paths replaced by the shown ones."""
    message = message.replace(str(path), shown(root, path))
    return message.replace(str(root) + os.sep, "").replace(str(root), "--lora-dir") if root is not None else message
