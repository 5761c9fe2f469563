"""Private files written atomically: keystores, the API token, node.json.

A file holding a secret is 0600 from its first byte (created that way, never
widened then narrowed), fully written and fsynced before it appears under its
name, and its directory is fsynced so that the rename survives a crash.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_private_file", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in `directory` durable (not possible everywhere, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _private_temp(directory: Path, name: str, data: bytes) -> Path:
    """A new file in `directory` holding `data`, mode 0600 from its creation, fsynced."""
    tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # the umask can only have removed bits; make it exact
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def write_private_file(path: str | os.PathLike[str], data: bytes, *, replace: bool) -> None:
    """Atomically place `data` at `path`, mode 0600. With `replace=False` an existing
    file is never clobbered: FileExistsError, even if it appeared meanwhile."""
    path = Path(path).absolute()
    tmp = _private_temp(path.parent, path.name, data)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic no-clobber
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: check, then rename
                if os.path.lexists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
            else:
                tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
