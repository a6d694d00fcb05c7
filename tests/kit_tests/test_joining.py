"""Joining a cluster waits on its engines in bounded time (no cluster: a stand-in client)."""

from __future__ import annotations

import pytest

from tests.kit.runtime import joining


class _Answer:
    def __init__(self, answers: bool) -> None:
        self.answers = answers

    def get(self, timeout: float | None = None) -> int:
        assert timeout is not None, "an unbounded wait on an engine"
        if not self.answers:
            raise TimeoutError("no answer")
        return 1234


class _Client:
    """Lists ``ids``; the engines in ``dead`` never answer; after ``drop_after`` rounds the controller
    drops them from its list (as it does once their heartbeats are missed)."""

    def __init__(self, ids: list[int], dead: set[int], drop_after: int | None) -> None:
        self._ids, self.dead, self.drop_after, self.rounds = ids, dead, drop_after, 0

    @property
    def ids(self) -> list[int]:
        self.rounds += 1
        if self.drop_after is not None and self.rounds > self.drop_after:
            return [eid for eid in self._ids if eid not in self.dead]
        return list(self._ids)

    def __getitem__(self, eid: int) -> _Client:
        self.asked = eid
        return self

    def apply_async(self, fn: object) -> _Answer:
        return _Answer(self.asked not in self.dead)


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joining, "JOIN_ANSWER_S", 0.05)
    monkeypatch.setattr(joining.time, "sleep", lambda s: None)


def test_a_dead_engine_still_listed_is_waited_out_until_the_controller_drops_it() -> None:
    client = _Client([0, 1, 2], dead={2}, drop_after=2)
    assert joining.answering_engines(client, "c") == [0, 1]


def test_an_engine_that_never_answers_is_named_within_the_settle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joining, "JOIN_SETTLE_S", 0.3)
    with pytest.raises(RuntimeError, match=r"engines \[2\] do not answer"):
        joining.answering_engines(_Client([0, 1, 2], dead={2}, drop_after=None), "c")
    with pytest.raises(RuntimeError, match="no engines"):
        joining.answering_engines(_Client([], dead=set(), drop_after=None), "c")
