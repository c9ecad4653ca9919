"""DirectHook (the per-step hook path) calls exactly what pluggy would, in pluggy's order."""
from __future__ import annotations

import pytest

from vllm_kvguard import manager
from vllm_kvguard.hookspecs import hookimpl


class _Impl:
    def __init__(self, tag, calls, result=None):
        self.tag, self.calls, self.result = tag, calls, result

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        self.calls.append((self.tag, scheduler, output))
        return self.result


class _Wrapper:
    def __init__(self, calls):
        self.calls = calls

    @hookimpl(wrapper=True)
    def kvguard_after_schedule(self, scheduler, output):
        self.calls.append(("wrapper", scheduler, output))
        return (yield)


@pytest.fixture
def registered():
    names = []

    def add(plugin, name):
        manager.register(plugin, name)
        names.append(name)

    yield add
    for name in names:
        manager.unregister(name)


def _pluggy(**kwargs):
    return manager.hook().kvguard_after_schedule(**kwargs)


def test_same_results_and_order_as_pluggy(registered):
    direct = manager.DirectHook("kvguard_after_schedule")
    calls: list = []
    registered(_Impl("first", calls, result=1), "t.first")
    registered(_Impl("second", calls), "t.second")
    registered(_Impl("third", calls, result=3), "t.third")
    got = direct(scheduler="s", output="o")
    direct_calls, calls[:] = list(calls), []
    want = _pluggy(scheduler="s", output="o")
    assert got == want
    assert [c for c in direct_calls if c[0] in ("first", "second", "third")] == [
        c for c in calls if c[0] in ("first", "second", "third")]
    assert direct.plan is not None          # called directly, not through pluggy


def test_plan_follows_registration(registered):
    direct = manager.DirectHook("kvguard_after_schedule")
    calls: list = []
    direct(scheduler=0, output=0)
    registered(_Impl("late", calls), "t.late")
    direct(scheduler=1, output=2)
    assert ("late", 1, 2) in calls
    manager.unregister("t.late")
    calls.clear()
    direct(scheduler=3, output=4)
    assert not calls


def test_a_wrapper_impl_goes_through_pluggy(registered):
    direct = manager.DirectHook("kvguard_after_schedule")
    calls: list = []
    registered(_Impl("plain", calls), "t.plain")
    registered(_Wrapper(calls), "t.wrapper")
    direct(scheduler="s", output="o")
    assert direct.plan is None
    assert ("wrapper", "s", "o") in calls and ("plain", "s", "o") in calls


def test_firstresult_stops_at_the_first_answer(registered):
    direct = manager.DirectHook("kvguard_after_schedule", firstresult=True)
    calls: list = []
    registered(_Impl("early", calls, result="a"), "t.early")
    registered(_Impl("last-registered", calls, result="b"), "t.last")
    assert direct(scheduler=None, output=None) == "b"     # pluggy calls LIFO
    assert [c[0] for c in calls] == ["last-registered"]
