"""After ``Scheduler.schedule()``: the ``kvguard_after_schedule`` implementations are called
directly (``manager.direct``), in pluggy's order, with pluggy's argument selection; a hook
wrapper sends the call through pluggy; an error of ours trips the patch, never the step.
REAL vLLM ``Scheduler``."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_kvguard.testing.kv_fixtures import make_request, make_scheduler, scheduler_step  # noqa: E402

from vllm_kvguard import activation, hostcall, manager  # noqa: E402
from vllm_kvguard.hookspecs import hookimpl  # noqa: E402
from vllm_kvguard.patches import allocator  # noqa: E402

pytestmark = pytest.mark.requires_patch("allocator")
seen: list = []


class Both:
    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        seen.append(("both", scheduler, output))


class OutputOnly:
    @hookimpl(tryfirst=True)
    def kvguard_after_schedule(self, output):
        seen.append(("output", output))


class Wrapping:
    @hookimpl(hookwrapper=True)
    def kvguard_after_schedule(self, scheduler, output):
        seen.append(("wrapper-before",))
        yield
        seen.append(("wrapper-after",))


class Raising:
    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        raise RuntimeError("a bug of ours")


@pytest.fixture(autouse=True)
def _plugins():
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    seen.clear()
    yield
    for name in ("test.both", "test.output", "test.wrapping", "test.raising"):
        manager.unregister(name)
    activation.deactivate()


def _scheduler_with_work():
    sched = make_scheduler(num_gpu_blocks=64)
    sched.add_request(make_request("r0", range(3, 40), max_tokens=4))
    return sched


def test_direct_calls_follow_pluggys_order_and_argument_selection():
    manager.register(Both(), "test.both")
    manager.register(OutputOnly(), "test.output")
    sched = _scheduler_with_work()
    out, _ = scheduler_step(sched)
    ours = [s for s in seen if s[0] in ("both", "output")]
    assert ours == [("output", out), ("both", sched, out)]       # tryfirst first
    pm = manager.get_plugin_manager()
    seen.clear()
    pm.hook.kvguard_after_schedule(scheduler=sched, output=out)  # pluggy's own order
    assert [s for s in seen if s[0] in ("both", "output")] == ours


def test_a_hook_wrapper_sends_the_call_through_pluggy():
    manager.register(Both(), "test.both")
    manager.register(Wrapping(), "test.wrapping")
    assert manager.direct("kvguard_after_schedule") is None
    sched = _scheduler_with_work()
    scheduler_step(sched)
    assert [s[0] for s in seen] == ["wrapper-before", "both", "wrapper-after"]
    manager.unregister("test.wrapping")
    seen.clear()
    scheduler_step(sched)
    assert [s[0] for s in seen] == ["both"]                      # direct again


def test_an_error_of_ours_trips_the_patch_and_the_step_goes_on():
    manager.register(Raising(), "test.raising")
    sched = _scheduler_with_work()
    out, _ = scheduler_step(sched)
    assert out.num_scheduled_tokens == {"r0": 37}                # vLLM's output returned
    assert hostcall.tripped(allocator.NAME)
    manager.register(Both(), "test.both")
    scheduler_step(sched)
    assert seen == []                                            # tripped: vLLM alone
