"""The differential tier: seeded random ``generate`` calls (architecture, features, batch, padding side, paged
cache, speculation, generate options including ``output_*`` flags, stop strings and seeded sampling), each compared
with the unpatched model: the same output, or the typed error docs/guarantees.md promises.

CI runs a bounded number of cases; ``pytest tests/test_differential.py --diff-cases 2000 --diff-features
default,native,compile`` runs a longer one. A failure names its case; ``draw(seed)`` rebuilds it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from differential import check, draw, promise
from helpers import ARCHS

OUTCOMES: Counter[str] = Counter()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "diff_seed" in metafunc.fixturenames:
        metafunc.parametrize("diff_seed", range(metafunc.config.getoption("diff_cases")))


def test_a_patched_generate_matches_the_unpatched_model_or_refuses_as_documented(diff_seed, request):
    features = tuple(request.config.getoption("diff_features").split(","))
    case = draw(diff_seed, ARCHS, features)
    tokenizer = request.getfixturevalue("default_model")[1] if case.stop else None
    OUTCOMES[check(case, tokenizer)] += 1


def test_the_drawn_cases_cover_every_promise():
    """The bounded run is only worth its minutes if its cases reach each outcome and option."""
    cases = [draw(seed, ARCHS) for seed in range(40)]
    promised = Counter(promise(c)[0] for c in cases)
    assert promised["equal"] >= 15 and promised["error"] >= 5 and promised["valid"] >= 1, promised
    assert {c.speculation for c in cases} == {"none", "lookup", "draft", "self"}
    assert {c.paged for c in cases} == {"off", "on", "prefix"} and any(c.right_pad for c in cases)
    assert any(c.stop for c in cases) and any(c.options.get("do_sample") for c in cases)
    assert len({c.arch for c in cases}) >= 6 and {c.init for c in cases} == {0.2, 0.02}
