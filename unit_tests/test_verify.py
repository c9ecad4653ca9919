"""Self-verified activation (vllm_kvguard.verify) on the installed vLLM made to report a
release newer than any proven (0.35.0): patches prove themselves on vLLM's real classes
before they apply, one WARNING per process tree says so, and a patch whose declared vLLM
name disappears is skipped with that name while the rest apply."""
from __future__ import annotations

import logging
import os

import pytest

vllm = pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401
import vllm.v1.core.sched.scheduler  # noqa: E402,F401

from vllm_kvguard import activation, process, report, verify  # noqa: E402
from vllm_kvguard.patches import BY_NAME  # noqa: E402
from vllm_kvguard.registry import is_wrapped  # noqa: E402
from vllm_kvguard.testing import kv_fixtures as kf  # noqa: E402
from vllm_kvguard.versions import vllm_version  # noqa: E402

NEXT = "0.35.0"


@pytest.fixture
def next_release(monkeypatch):
    """The installed vLLM reports 0.35.0, outside every patch's declared range. Where the
    installed vLLM is too old to pass for it (names the allocator declares for newer
    releases are absent, e.g. 0.27.1), the test skips with the first such name."""
    from packaging.version import Version

    absent = BY_NAME["allocator"].drift(Version(NEXT))
    if absent:
        pytest.skip(f"vLLM {vllm_version()} cannot pass for {NEXT}: {absent[0]} is absent")
    monkeypatch.setattr(vllm, "__version__", NEXT)
    assert not any(p.supports(vllm_version()) for p in BY_NAME.values())
    yield


def _raw(cls, name):
    return vars(cls)[name]


def test_allocator_verifies_applies_and_rolls_back_a_failing_multi_group_allocation(
        next_release, kvguard_log):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    assert res["allocator"].startswith("applied (verified)"), res
    assert "allocator" in verify.seconds()
    assert is_wrapped(_raw(KVCacheManager, "allocate_slots"))
    assert report.snapshot() == {}            # the self-test's rollback is not the engine's
    # the applied patch rolls back a multi-group allocation failing in a later group
    m = kf.hybrid_manager(48)
    assert len(kf.groups(m)) >= 2
    req = kf.make_request("r", list(range(3, 51)))
    before = kf.state(m)
    calls = [0]
    grant = m.block_pool.get_new_blocks

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("Cannot get 3 free blocks from the pool")
        return grant(*a, **k)

    m.block_pool.get_new_blocks = failing
    assert m.allocate_slots(req, 32) is None and calls[0] == 2
    assert kf.state_diff(before, kf.state(m)) == []
    assert report.snapshot()["rollback"] == {"ValueError": 1}
    # one WARNING names the version and the proven range; the startup line marks it
    warnings = [w for w in kvguard_log.lines(logging.WARNING) if "proven range" in w]
    assert len(warnings) == 1, warnings
    assert f"vLLM {NEXT} is outside the proven range {verify.proven_range()}" in warnings[0]
    assert "verified on it and applied: allocator, distributed;" in warnings[0]
    line, = [m for m in kvguard_log.lines(logging.INFO) if " active in " in m]
    assert "on: allocator*" in line and "*verified here" in line and len(line) < 200


def test_a_vanished_name_skips_only_its_patch_naming_it(next_release, monkeypatch,
                                                        kvguard_log):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_build_kv_connector_meta")
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "-cudagraph"})
    assert res["containment"].startswith("skipped: not in this vLLM: ")
    assert "vllm.v1.core.sched.scheduler.Scheduler._build_kv_connector_meta" in \
        res["containment"]
    # the rest apply: every other chosen patch whose names resolve here at 0.35.0 (a
    # declaration branched on the version may expect names an older install lacks)
    rest = [n for n in res if n != "containment" and not verify.preflight(BY_NAME[n],
                                                                           vllm_version())]
    assert "allocator" in rest
    for name in rest:
        assert res[name].startswith("applied (verified)"), (name, res[name])
    warning, = kvguard_log.lines(logging.WARNING)
    assert "not applied: " in warning and "containment (not in this vLLM: " in warning
    assert "_build_kv_connector_meta" in warning


def test_inside_the_range_nothing_is_verified():
    res = activation.activate({"KVGUARD": "1"})
    assert all(not r.startswith("skipped") for r in res.values()), res
    assert verify.seconds() == {}


def test_force_applies_without_checks(next_release, monkeypatch):
    monkeypatch.setitem(verify.CHECKS, "allocator", lambda: pytest.fail("must not run"))
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                               "KVGUARD_FORCE": "1"})
    assert res["allocator"] == "applied (forced outside its range)"
    assert verify.seconds() == {}


def test_a_child_process_reuses_the_verdict_and_does_not_warn_again(next_release,
                                                                    kvguard_log):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    inherited = {k: os.environ[k] for k in (verify.ENV_VERIFIED, process.ENV_NOTED)}
    activation.deactivate()                    # a child: same environment, fresh process
    os.environ.update(inherited)
    try:
        res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
        assert res["allocator"].startswith("applied (verified)")
        assert verify.seconds() == {}          # not tested again: the tree's verdict
        assert len(kvguard_log.lines(logging.WARNING)) == 1
    finally:
        for k in inherited:
            os.environ.pop(k, None)


def test_an_inherited_failure_keeps_the_patch_off(next_release):
    verify._remember(vllm_version(), "allocator", "self-test failed: state not restored")
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    assert res["allocator"] == "skipped: self-test failed: state not restored"
    assert not BY_NAME["allocator"].applied


def test_signature_drift_names_the_moved_parameter(monkeypatch):
    from vllm_kvguard.verify.signatures import signature_drift

    assert signature_drift(BY_NAME["allocator"]) == []

    def allocate_slots(self, num_new_tokens, request):     # parameters swapped
        return None

    monkeypatch.setattr(vllm.v1.core.kv_cache_manager.KVCacheManager, "allocate_slots",
                        allocate_slots)
    problems = signature_drift(BY_NAME["allocator"])
    assert problems and "'request' moved to position 1" in problems[0]


@pytest.mark.parametrize("name", sorted(verify.CHECKS))
def test_each_self_test_passes_on_this_vllm(name):
    """Every pin: the behavioural self-tests hold on the installed vLLM (patch applied)."""
    patch = BY_NAME[name]
    if not patch.targets_in():
        pytest.skip(f"{name} has no target in this vLLM")
    patch.apply(None)
    try:
        assert verify.run_check(name) == ""
    finally:
        patch.revert()


def test_the_allocator_self_test_fails_without_the_fix():
    """The self-test could fail: without the patch the failing allocation escapes."""
    assert "escaped" in verify.run_check("allocator")
