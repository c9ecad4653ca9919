"""Self-verified activation (vllm_kvguard.verify) on the installed vLLM made to report a
release newer than any proven (0.35.0): patches prove themselves on vLLM's real classes
before they apply, one WARNING per process tree says so, and a patch whose declared vLLM
name disappears is skipped with that name while the rest apply."""
from __future__ import annotations

import logging
import os

import pytest

vllm = pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401,F811
import vllm.v1.core.sched.scheduler  # noqa: E402,F401

from vllm_kvguard import activation, process, report, verify  # noqa: E402
from vllm_kvguard.patches import BY_NAME, allocator  # noqa: E402
from vllm_kvguard.registry import is_wrapped  # noqa: E402
from vllm_kvguard.testing import kv_fixtures as kf  # noqa: E402
from vllm_kvguard.versions import vllm_version  # noqa: E402

NEXT = "0.35.0"


@pytest.fixture
def next_release(monkeypatch):
    """The installed vLLM reports 0.35.0, outside every patch's declared range. Where the
    installed vLLM is too old to pass for it (names the allocator or the always-on
    distributed patch declare for newer releases are absent, e.g. 0.27.1, 0.31.0), the
    test skips with the first such name."""
    from packaging.version import Version

    absent = (BY_NAME["allocator"].drift(Version(NEXT))
              + BY_NAME["distributed"].drift(Version(NEXT)))
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
    pool, bound = m.block_pool, allocator.fast_bound(m, 32)
    pool.get_new_blocks(pool.get_num_free_blocks() - bound + 1)   # below it: the call records
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
    # the rest apply: every other chosen patch whose names resolve here at 0.35.0 (a
    # declaration branched on the version may expect names an older install lacks);
    # asked first, so every module they name is loaded and checked at activation
    rest = [n for n in BY_NAME if n not in ("containment", "cudagraph", "faults")
            and not verify.preflight(BY_NAME[n], vllm_version())]
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "-cudagraph"})
    assert res["containment"].startswith("skipped: not in this vLLM: ")
    assert "vllm.v1.core.sched.scheduler.Scheduler._build_kv_connector_meta" in \
        res["containment"]
    assert "allocator" in rest
    for name in rest:              # verified here, or applied with its self-test due there
        want = activation.PENDING if name in verify.WHERE else "applied (verified)"
        assert res[name].startswith(want), (name, res[name])
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
                                                                    kvguard_log,
                                                                    monkeypatch):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    inherited = {k: os.environ[k] for k in (verify.ENV_VERIFIED, process.ENV_NOTED)}
    activation.deactivate()                    # a child: same environment, fresh process
    os.environ.update(inherited)
    # nor is the drift guard run again (it imports every module a patch names)
    monkeypatch.setattr(verify, "preflight", lambda *a: pytest.fail("drift guard again"))
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


# ------------------------------------------------ self-tests that run where their target runs
def _outside_for(monkeypatch, *names: str) -> str:
    """Make the installed vLLM report a release outside the proven range on which the
    names of patches ``names`` all resolve (newer where it can pass for one, else older:
    0.32.0 code lacks names the patches declare for 0.34+); skip if there is none."""
    from packaging.version import Version

    for version in (NEXT, "0.27.0"):
        if not any(verify.preflight(BY_NAME[n], Version(version)) for n in names):
            monkeypatch.setattr(vllm, "__version__", version)
            assert not any(BY_NAME[n].supports(vllm_version()) for n in names)
            return version
    pytest.skip(f"vLLM {vllm_version()} passes for no release outside the range for {names}")


def _guarded(connector) -> bool:
    return "get_num_new_matched_tokens" in vars(connector)


def test_containment_self_test_waits_for_the_scheduler_and_runs_on_its_config(
        monkeypatch, kvguard_log):
    from vllm_kvguard.testing.connector_fixtures import make_connector_scheduler

    _outside_for(monkeypatch, "containment")
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "containment"})
    # the front end: applied, its self-test not run here (no scheduler in this process yet)
    assert res["containment"] == activation.PENDING and verify.pending("containment")
    assert verify.seconds() == {}
    line, = [m for m in kvguard_log.lines(logging.INFO) if " active in " in m]
    assert "on: containment+" in line           # + : its self-test runs where it runs
    warning, = [w for w in kvguard_log.lines(logging.WARNING) if "proven range" in w]
    assert "self-test where its target runs: containment;" in warning
    # the scheduler's process: its Scheduler's connector runs the self-test first, on that
    # Scheduler's own config, then is guarded
    sched = make_connector_scheduler(defers=0)
    assert activation.results()["containment"] == "applied (verified)"
    assert "containment" in verify.seconds() and not verify.pending("containment")
    assert _guarded(sched.connector)
    assert any("containment self-test passed in" in m for m in kvguard_log.lines(logging.INFO))
    assert report.snapshot() == {}            # the self-test's contained error is not counted


def _scheduler_process(queue) -> None:
    """A forked "scheduler's process": builds its Scheduler (the self-test runs there)."""
    from vllm_kvguard.testing.connector_fixtures import make_connector_scheduler

    sched = make_connector_scheduler(defers=0)
    queue.put((activation.results()["containment"], BY_NAME["containment"].applied,
               _guarded(sched.connector)))


def test_a_failing_containment_self_test_reverts_it_in_the_scheduler_process_only(
        monkeypatch):
    import multiprocessing

    def fails(vllm_config=None):
        assert vllm_config is not None        # given the scheduler's own config
        raise verify.SelfTestFailed("the connector error escaped schedule()")

    _outside_for(monkeypatch, "containment")
    monkeypatch.setitem(verify.CHECKS, "containment", fails)
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission,containment"})
    assert res["containment"] == activation.PENDING
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_scheduler_process, args=(queue,))
    child.start()
    try:
        result, applied, guarded = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert result == "skipped: self-test failed: the connector error escaped schedule()"
    assert not applied and not guarded       # reverted there: vLLM's own connector calls
    # this process (the front end) is untouched: still applied, its self-test still due
    assert BY_NAME["containment"].applied and verify.pending("containment")
    assert activation.results()["containment"] == activation.PENDING
    assert activation.results()["admission"].startswith("applied")


def test_a_process_started_during_a_self_test_runs_none_and_leaves_the_patch_off(
        next_release, monkeypatch):
    """vLLM's model registry probe (a subprocess a self-test's config can start) loads the
    plugin: were it to self-test too, each level would start the next."""
    monkeypatch.setitem(verify.CHECKS, "allocator", lambda: pytest.fail("must not run"))
    monkeypatch.setenv(verify.ENV_TESTING, "admission")
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    assert res["allocator"].startswith("skipped: not verified: started during the admission")
    assert not BY_NAME["allocator"].applied and verify.seconds() == {}


def test_a_self_test_marks_the_processes_it_starts(monkeypatch):
    seen = []
    monkeypatch.setitem(verify.CHECKS, "allocator",
                        lambda: seen.append(os.environ.get(verify.ENV_TESTING)))
    assert verify.run_check("allocator") == ""
    assert seen == ["allocator"] and verify.ENV_TESTING not in os.environ


# ------------------------------------- admission: proven where its limits are made
def test_admission_self_test_runs_on_the_engines_config_before_its_limits_are_published(
        monkeypatch, kvguard_log):
    from vllm_kvguard.fixes.estimation import admission
    from vllm_kvguard.verify import estimation

    _outside_for(monkeypatch, "admission", "warmup")
    seen = []

    def recorded(vllm_config=None):
        seen.append((vllm_config, admission.published()))
        estimation.admission(vllm_config=vllm_config)

    monkeypatch.setitem(verify.CHECKS, "admission", recorded)
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission,warmup"})
    # the front end: applied, its self-test not run here (no scheduler, no config built)
    assert res["admission"] == activation.PENDING and verify.pending("admission")
    assert "admission" not in verify.seconds() and seen == []
    # the scheduler's process: its Scheduler's config is the test's, no stand-in is built
    monkeypatch.setattr(kf, "make_vllm_config", lambda **kw: pytest.fail("stand-in built"))
    sched = kf.make_scheduler(num_gpu_blocks=17)
    assert len(seen) == 1 and seen[0] == (sched.vllm_config, None)   # before publishing
    assert activation.results()["admission"] == "applied (verified)"
    assert "admission" in verify.seconds() and not verify.pending("admission")
    assert any("admission self-test passed in" in m for m in kvguard_log.lines(logging.INFO))
    limits = admission.published()                # the engine's limits, not the test's
    assert (limits["prompt_limit"], limits["usable"], limits["max_model_len"]) == (256, 16, 512)
    assert (sched.vllm_config.model_config.max_model_len,
            sched.vllm_config.cache_config.num_gpu_blocks) == (512, 17)   # untouched


def test_a_failing_admission_self_test_publishes_nothing_and_the_front_end_hears_it(
        monkeypatch, kvguard_log):
    import json

    from vllm_kvguard import remote
    from vllm_kvguard.fixes.estimation import admission

    from vllm_kvguard.verify import estimation

    def fails(vllm_config=None):
        assert vllm_config is not None            # given the scheduler's own config
        estimation.admission(vllm_config)         # its private schedulers publish nothing
        raise verify.SelfTestFailed("the allocator took 257")

    _outside_for(monkeypatch, "admission", "warmup")
    monkeypatch.setitem(verify.CHECKS, "admission", fails)
    # EngineCore: the self-test fails before publishing; nothing is published, the patch
    # is off there and its verdict is in this process's entry of the counters' reply
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission,warmup"})
    kf.make_scheduler(num_gpu_blocks=17)
    reason = "self-test failed: the allocator took 257"
    assert activation.results()["admission"] == f"skipped: {reason}"
    assert not BY_NAME["admission"].applied and admission.published() is None
    assert any("patch 'admission' off in" in m for m in kvguard_log.lines(logging.WARNING))
    sent = json.loads(json.dumps(remote.entry()))
    assert sent["offers"][verify.VERDICTS]["admission"].startswith(reason + " (in ")
    assert admission.KEY not in sent["offers"]
    activation.deactivate()
    # the front end (another process): pending until the engine's reply brings the verdict
    sent["pid"] = os.getpid() + 1

    class Engine:                                   # LLMEngine's collective_rpc reply
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [sent]

    engine = Engine()
    try:
        activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission"})
        assert verify.pending("admission") and BY_NAME["admission"].applied
        remote.attach(engine, is_async=False)
        assert admission.published() is None       # the door: no limits, admits everything
        assert not verify.pending("admission") and not BY_NAME["admission"].applied
        assert activation.results()["admission"].startswith(f"skipped: {reason} (in ")
    finally:
        remote.reset()
