"""Private files: written atomically, read only when nobody else could have put them there.

A file holding a secret is 0600 from its first byte (created that way, never
widened then narrowed), fully written and fsynced before it appears under its
name, and its directory is fsynced so that the rename survives a crash.

Reading trusts nothing another local user could have planted (docs/protocol.md,
"The data directory"): `check_private_dir` refuses a directory that is a symlink,
not the running user's, or writable by group/others, and likewise each directory
above it unless root's or sticky (else another user could swap it); `read_secret`
opens with O_NOFOLLOW and judges the opened descriptor (fstat, no separate stat
to race), and only ever narrows a mode with fchmod on that descriptor, so a
symlink can never make the node read or chmod a file it points at.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

__all__ = ["write_private_file", "fsync_dir", "UnsafePath", "check_private_dir", "check_path_file", "read_secret"]

log = logging.getLogger("hmpnode.fsutil")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafePath(Exception):
    """A file or directory another local user could have written or replaced.
    `str()` is one line naming the path and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def _owner_problem(st: os.stat_result, *, root_ok: bool = False) -> str | None:
    if os.name == "nt":
        return None
    euid = os.geteuid()
    if st.st_uid != euid and not (root_ok and st.st_uid == 0):
        return f"owned by uid {st.st_uid}, not by the user running the node (uid {euid})"
    return None


def _judge(st: os.stat_result, what: str, *, root_ok: bool = False) -> str | None:
    """Why a file or directory with this (l)stat cannot be trusted, or None."""
    if os.name == "nt":
        return None
    problem = _owner_problem(st, root_ok=root_ok)
    if problem:
        return f"{what} is {problem}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        return f"{what} is writable by {'group and others' if mode & 0o022 == 0o022 else 'group' if mode & 0o020 else 'others'} (mode {mode:o}); chmod go-w it"
    return None


def check_private_dir(path: str | os.PathLike[str], what: str = "data dir") -> None:
    """UnsafePath unless `path` is a real directory (not a symlink) of the running
    user that group/others cannot write, and every directory above it is the
    user's or root's and not writable by others unless sticky (as /tmp is):
    otherwise another user could rename it away and put their own in its place."""
    if os.name == "nt":
        return
    path = Path(path).absolute()
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(path, f"cannot inspect the {what}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, f"the {what} is a symlink; give the real path instead")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, f"the {what} is not a directory")
    problem = _judge(st, f"the {what}")
    if problem:
        raise UnsafePath(path, problem)
    for parent in path.parents:
        try:
            pst = os.stat(parent)
        except OSError as exc:
            raise UnsafePath(parent, f"cannot inspect a parent of the {what}: {exc.strerror or exc}") from None
        owner = _owner_problem(pst, root_ok=True)
        if owner:
            raise UnsafePath(parent, f"a parent of the {what} is {owner}, who could replace it")
        if stat.S_IMODE(pst.st_mode) & 0o022 and not pst.st_mode & stat.S_ISVTX:
            raise UnsafePath(parent, f"a parent of the {what} is writable by other users (mode "
                             f"{stat.S_IMODE(pst.st_mode):o}, not sticky), who could replace it")


def check_path_file(path: str | os.PathLike[str], what: str, *, root_ok: bool = False) -> None:
    """For a file the node opens by name (the store, its WAL): UnsafePath if it
    exists and is a symlink, not a regular file, not the user's, or writable by
    group/others. Sound only inside a directory `check_private_dir` accepted."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafePath(path, f"cannot inspect the {what}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, f"the {what} is a symlink; the node does not follow links in its data dir")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(path, f"the {what} is not a regular file")
    problem = _judge(st, f"the {what}", root_ok=root_ok)
    if problem:
        raise UnsafePath(path, problem)


def read_secret(path: str | os.PathLike[str], what: str, limit: int, *, root_ok: bool = False,
                tighten: bool = True) -> bytes:
    """The content of a secret file, read only if nobody else could have written it.

    Opened with O_NOFOLLOW (a symlink is refused, never followed) and judged by
    fstat on that descriptor: a regular file of the running user (or root's, with
    `root_ok`, e.g. a passphrase file handed over by the service manager), not
    writable by group/others, at most `limit` bytes. Read access for group/others
    is taken away with fchmod on the same descriptor (`tighten`; the secret may
    have been read, so a warning says so) or only warned about.
    FileNotFoundError if it is missing; UnsafePath for everything else."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        if os.path.islink(path):  # ELOOP (Linux) / EMLINK (FreeBSD) for O_NOFOLLOW on a link
            raise UnsafePath(path, f"the {what} is a symlink; the node does not follow links to secrets") from None
        raise UnsafePath(path, f"cannot open the {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(path, f"the {what} is not a regular file")
        problem = _judge(st, f"the {what}", root_ok=root_ok)
        if problem:
            raise UnsafePath(path, problem)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077 and os.name != "nt":
            if tighten and st.st_uid == os.geteuid():
                os.fchmod(fd, mode & 0o700)
                log.warning("the %s %s was readable by other users (mode %o); mode set to %o - if others "
                            "could reach it, consider it leaked and replace it", what, path, mode, mode & 0o700)
            else:
                log.warning("the %s %s is readable by other users (mode %o)", what, path, mode)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UnsafePath(path, f"the {what} is larger than {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise UnsafePath(path, f"cannot read the {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


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
