"""The results folder (`serve --results DIR`): the files jobs make (a video job's MP4, an async image job's answer)
and the input pictures of edit jobs, kept for `--keep-results-h` hours and then swept. No torch.

One flat folder, local or shared (every replica that answers GET .../content must read the same one). Safe with
several processes on one folder:
- write() is atomic: the bytes go to a temporary file in the same folder (a name starting with "." and ending in
  ".tmp"), are flushed to disk (fsync), and the file is then renamed over its name (os.replace), so a reader sees
  either nothing or the whole file, never a part;
- sweep() removes files older than keep_s (by modification time) and temporary files left over by a process that
  died mid-write (older than a minute); two processes sweeping at once only find some files gone already;
- names are plain file names (letters, digits, ".", "_", "-"; not starting with "."): path() refuses any other, so
  no name reaches outside the folder.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
TMP_SUFFIX = ".tmp"
LEFTOVER_S = 60.0  # a temporary file older than this was left by a write that never finished


class Results:
    def __init__(self, root: str | os.PathLike, keep_s: float, temporary: bool = False) -> None:
        if keep_s <= 0:
            raise ValueError(f"keep_s must be > 0, got {keep_s}")
        self.root = Path(root)
        self.keep_s = keep_s
        self.temporary = temporary  # removed with everything in it by close()
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def in_temporary_folder(cls, keep_s: float = 24 * 3600.0) -> "Results":
        """A folder of this process's own, removed at close() (`--state memory`: nothing outlives the process)."""
        return cls(tempfile.mkdtemp(prefix="stepserve-results-"), keep_s, temporary=True)

    def path(self, name: str) -> Path:
        """Where `name` is (or would be). ValueError for a name that is not a plain file name."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"not a result file name: {name!r} (letters, digits, '.', '_' and '-', not starting "
                             f"with '.')")
        return self.root / name

    def write(self, name: str, data: bytes) -> str:
        """Store `data` under `name`, atomically; returns the name."""
        final = self.path(name)
        tmp = self.root / f".{name}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return name

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when there is no such file (never written, deleted or swept)."""
        try:
            return self.path(name).read_bytes()
        except FileNotFoundError:
            return None

    def touch(self, names: Iterable[str]) -> None:
        """Make files young again (an edit job's inputs when it starts again: they must outlive its run)."""
        for name in names:
            try:
                os.utime(self.path(name))
            except FileNotFoundError:
                pass

    def delete(self, names: Iterable[str]) -> None:
        """Remove these files; one that is gone already is no error."""
        for name in names:
            self.path(name).unlink(missing_ok=True)

    def sweep(self, now: float) -> list[str]:
        """Remove the files last written before now - keep_s, and temporary files older than a minute; returns the
        names removed."""
        removed = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return removed
        for entry in entries:
            leftover = entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:  # another process swept it first
                continue
            if age > (LEFTOVER_S if leftover else self.keep_s):
                try:
                    os.unlink(entry.path)
                    removed.append(entry.name)
                except FileNotFoundError:
                    pass
        return removed

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)
