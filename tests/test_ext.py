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


def test_a_long_build_logs_progress_until_it_ends(caplog):
    import time

    from hf_accel.kernels.build import ticking

    with caplog.at_level("WARNING", logger="hf_accel"):
        with ticking("building the test kernels", every=0.05):
            time.sleep(0.18)
        ticks = [r.getMessage() for r in caplog.records]
        time.sleep(0.12)  # none after the block
    assert len(ticks) >= 2 and all(t.startswith("hf_accel: still building the test kernels (") for t in ticks)
    assert len(caplog.records) == len(ticks)
    with caplog.at_level("WARNING", logger="hf_accel"), ticking("nothing", active=False, every=0.01):
        time.sleep(0.05)
    assert len(caplog.records) == len(ticks)
