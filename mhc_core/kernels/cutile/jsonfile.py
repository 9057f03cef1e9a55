"""An atomic JSON write: the tuning files and the GPU tools' `--out` files."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

__all__ = ["write_json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str, data: dict) -> None:
    """The `--out` file of the GPU tools, replaced atomically (a reader never sees half a file)."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would otherwise be the file's mode
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:  # nothing left behind on the way to an error
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
