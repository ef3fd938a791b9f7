"""`run.gc_every`: Python's garbage collector is off while a step runs, collects fully every `gc_every` steps
between them, and is on again however the loop ends."""

from __future__ import annotations

import gc

import pytest

from megatron_gptoss.config import ConfigError, RunConfig
from megatron_gptoss.utils.host import collect_between_steps


@pytest.fixture
def collections(monkeypatch):
    calls: list[bool] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(gc.isenabled()) or real(*a))
    assert gc.isenabled()
    yield calls
    gc.enable()


def test_off_during_steps_and_collected_every_n(collections):
    seen = []
    for step in collect_between_steps(range(1, 8), 3):
        seen.append((step, gc.isenabled(), len(collections)))
    # one collection before the first step, then after steps 3 and 6
    assert seen == [(1, False, 1), (2, False, 1), (3, False, 1), (4, False, 2), (5, False, 2), (6, False, 2),
                    (7, False, 3)]  # fmt: skip
    assert gc.isenabled() and len(collections) == 3


def test_on_again_after_a_break_or_an_error(collections):
    for step in collect_between_steps(range(1, 100), 5):
        if step == 2:
            break
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        for _step in collect_between_steps(range(1, 100), 5):
            assert not gc.isenabled()
            raise RuntimeError("step failed")
    assert gc.isenabled()


def test_zero_leaves_the_collector_to_python(collections):
    assert [(step, gc.isenabled()) for step in collect_between_steps(range(3), 0)] == [(0, True), (1, True),
                                                                                       (2, True)]  # fmt: skip
    assert collections == []


def test_negative_is_refused():
    with pytest.raises(ConfigError, match="run.gc_every"):
        RunConfig(gc_every=-1).validate()
