"""The native-kernel build helper: a lock file left by a killed build must not hang later processes."""

from __future__ import annotations

import logging
import sys

import pytest

from hf_accel.kernels import build


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_build_lock_clears_a_lock_file_left_by_a_killed_build(tmp_path, caplog):
    (tmp_path / "lock").touch()  # what cpp_extension leaves when its process dies mid-build
    with caplog.at_level(logging.WARNING, logger="hf_accel.kernels.build"), build._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()  # cleared before the build starts, so load() does not wait
    assert f"removing {tmp_path / 'lock'} left by an interrupted build" in caplog.text
    with build._build_lock(tmp_path):  # released on exit: a second build takes it again at once
        assert (tmp_path / "hf_accel.lock").exists()
