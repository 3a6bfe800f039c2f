"""The shared/exclusive gate (core): exact ordering of holders."""

from __future__ import annotations

import copy
import pickle
import threading

from hf_accel.core.gate import SharedExclusiveGate


def test_shared_holders_overlap_and_an_exclusive_one_runs_alone():
    gate = SharedExclusiveGate()
    log: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def exclusive() -> None:
        with gate.exclusive():
            log.append("exclusive")

    def late_shared() -> None:
        with gate.shared():
            log.append("late shared")

    with gate.shared(), gate.shared():  # two shared holders at once (one thread, for the count)
        waiter = threading.Thread(target=exclusive)
        waiter.start()
        while not gate._waiting:  # the exclusive holder waits for the shared ones
            threading.Event().wait(0.001)
        late = threading.Thread(target=late_shared)  # arrives after it: goes after it
        late.start()
        late.join(0.05)
        assert log == [] and late.is_alive()
    waiter.join(5)
    late.join(5)
    assert log == ["exclusive", "late shared"]

    def holds_exclusive() -> None:
        with gate.exclusive():
            inside.set()
            release.wait(5)

    holder = threading.Thread(target=holds_exclusive)
    holder.start()
    inside.wait(5)
    blocked = threading.Thread(target=late_shared)
    blocked.start()
    blocked.join(0.05)
    assert blocked.is_alive() and log == ["exclusive", "late shared"]  # a shared holder waits for an exclusive one
    release.set()
    holder.join(5)
    blocked.join(5)
    assert log == ["exclusive", "late shared", "late shared"]


def test_copies_get_their_own_gate():
    gate = SharedExclusiveGate()
    with gate.exclusive():
        for other in (copy.deepcopy(gate), pickle.loads(pickle.dumps(gate))):
            with other.exclusive():  # not held: would block forever if shared with the original
                pass
