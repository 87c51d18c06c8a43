"""``--api-keys-file`` read again when it changes (``edge/keyfile.py``): the file itself,
no router."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd_router.edge.auth import KeyFileError
from pd_router.edge.keyfile import KeyFile
from pd_router.errors import Unauthorized

ALICE = "sk-alice-0123456789"
ERIN = "sk-erin-9876543210"  # as long as ALICE's: the file's size does not change


def accepted(keys: KeyFile, key: str) -> bool:
    try:
        keys.keys.check([f"Bearer {key}".encode()])
    except Unauthorized:
        return False
    return True


def test_an_edit_in_place_of_the_same_size_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE}\n")
    keys = KeyFile(str(path))
    assert accepted(keys, ALICE) and not keys.refresh()
    before = path.stat()
    with open(path, "r+", encoding="utf-8") as file:  # the same inode, the same size
        file.write(f"erin  {ERIN}\n")
    # File times tick coarsely: make sure this edit's mtime is not the last one's.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert keys.refresh()
    assert accepted(keys, ERIN) and not accepted(keys, ALICE)


def test_a_file_gone_keeps_the_last_good_keys_and_none_at_start_refuses(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE}\n")
    keys = KeyFile(str(path))
    path.unlink()
    assert not keys.refresh()
    assert accepted(keys, ALICE)
    with pytest.raises(KeyFileError, match="cannot be read"):
        KeyFile(str(path))
