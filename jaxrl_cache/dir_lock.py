"""One writer per directory: a lock file the first process to claim a directory holds until
it exits.

`claim(directory)` takes an exclusive `fcntl.flock` on `directory/.jaxrl_cache.lock` and
writes its pid there. The kernel drops the lock when its holder dies (kill -9 included), so
a stale lock of a dead process is simply taken over; while the holder lives, `claim` raises
`DirectoryInUse` naming its pid. Claims are remembered per process (a forked child inherits
none) and re-checked against the file on disk, so a directory deleted and made again is
claimed again. Readers need no lock: writers publish by atomic renames.
"""
from __future__ import annotations

import fcntl
import os
import pathlib

LOCK_FILE = ".jaxrl_cache.lock"
_held: dict[pathlib.Path, tuple[int, int]] = {}  # lock file -> (pid, fd) of a claim


class DirectoryInUse(ValueError):
    """Another live process holds the directory's lock."""

    def __init__(self, directory: pathlib.Path, pid: str):
        self.directory, self.pid = directory, pid
        super().__init__(f"{directory} is in use by pid {pid}")


def _is_open_file(fd: int, path: pathlib.Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    open_st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (open_st.st_dev, open_st.st_ino)


def claim(directory) -> None:
    """Makes this process the one writer of the existing `directory` until it exits (a no-op
    if it already is). DirectoryInUse if another live process is."""
    path = pathlib.Path(directory).resolve() / LOCK_FILE
    held = _held.get(path)
    if held is not None and held[0] == os.getpid() and _is_open_file(held[1], path):
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryInUse(path.parent, holder) from None
        if _is_open_file(fd, path):
            break
        os.close(fd)  # deleted or replaced between open and flock: lock the file there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if held is not None and held[0] == os.getpid():
        os.close(held[1])  # the lock of a file since deleted
    _held[path] = (os.getpid(), fd)
