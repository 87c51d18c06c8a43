"""``--api-keys-file``: read at start, read again whenever it changes, with no restart.

A Kubernetes Secret mounted as a volume is a symlink to a symlink (``keys`` ->
``..data/keys``, ``..data`` -> a timestamped directory) that the kubelet swaps in one
rename: the path's own mtime never changes. So the watch looks at what the path resolves
to, once a second (a ``stat``: the request path never touches the file): its device and
inode (a swap or a rename over it), its change time, mtime and size (an edit in place).

A file that cannot be read or parsed keeps the last good keys and says so once, in one
error line naming the file and the line (never a key), until it changes again. At start
there is nothing to keep: the router refuses to start.
"""

from __future__ import annotations

import logging
import os

import anyio

from pd_router.edge.auth import KeyFileError, Keys, parse

log = logging.getLogger("pd_router.keys")

WATCH_INTERVAL = 1.0

Signature = tuple[int, int, int, int, int] | None


class KeyFile:
    """The file's last good keys, in ``keys``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = _signature(path)
        self.keys = self._read()  # KeyFileError at start: nothing to fall back on
        if not self.keys:
            log.warning("api keys file %s holds no key: every /v1/ request gets 401", path)

    def refresh(self) -> bool:
        """Read the file again if it changed since it was last seen; True if keys changed."""
        seen = _signature(self.path)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            keys = self._read()
        except KeyFileError as exc:
            log.error("%s; keeping the last good keys (%d)", exc, len(self.keys))
            return False
        self.keys = keys
        log.info("api keys file %s read again: %d keys", self.path, len(keys))
        return True

    async def watch(self, interval: float = WATCH_INTERVAL) -> None:
        while True:
            await anyio.sleep(interval)
            self.refresh()

    def _read(self) -> Keys:
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise KeyFileError(f"api keys file {self.path}: cannot be read: {reason}") from None
        try:
            return parse(text)
        except KeyFileError as exc:
            raise KeyFileError(f"api keys file {self.path}: {exc}") from None


def _signature(path: str) -> Signature:
    try:
        st = os.stat(path)  # follows the symlinks: the file they lead to now
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)
