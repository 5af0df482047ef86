"""Private directories (traces, recordings, rank logs, profiles): 0700, and safe
when several rank processes create the same one at once."""

from __future__ import annotations

import os
import stat

import pytest

from runtime import private_files
from runtime.private_files import make_private_dirs


def test_missing_parents_are_made_0700(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    make_private_dirs(target)
    for path in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    make_private_dirs(target)  # again: nothing to do


def test_a_directory_made_meanwhile_by_another_process_is_fine(tmp_path, monkeypatch):
    target = tmp_path / "logs"
    real_isdir = os.path.isdir
    made_by_sibling = {"done": False}

    def isdir(path):  # the check runs before the sibling's mkdir, the mkdir after it
        if os.fspath(path) == os.fspath(target) and not made_by_sibling["done"]:
            os.mkdir(target, 0o700)
            made_by_sibling["done"] = True
            return False
        return real_isdir(path)

    monkeypatch.setattr(private_files.os.path, "isdir", isdir)
    make_private_dirs(target)  # os.mkdir meets FileExistsError: the sibling's directory
    assert real_isdir(target) and made_by_sibling["done"]


def test_a_file_in_the_way_still_fails(tmp_path):
    target = tmp_path / "logs"
    target.write_text("not a directory")
    with pytest.raises(FileExistsError):
        make_private_dirs(target)
