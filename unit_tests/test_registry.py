"""The patch registry and activation, on real vLLM targets."""
import logging
import subprocess
import sys
import types

import pytest

from vllm_kvguard import activation, manager
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.patches import BY_NAME, distributed
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import (ContainerItem, InstanceAttr, ModuleGlobal, Patch, Private,
                                   Target, is_wrapped)

ON = {"KVGUARD": "1"}


def _raw(cls, name):
    return vars(cls)[name]


def test_off_wraps_nothing():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    before = _raw(KVCacheManager, "allocate_slots")
    assert activation.activate({}) is None
    assert activation.wrapped_targets() == []
    assert _raw(KVCacheManager, "allocate_slots") is before and not is_wrapped(before)


def test_register_with_flag_off_imports_nothing_heavy():
    code = ("import sys, vllm_kvguard; vllm_kvguard.register(); "
            "print(sorted(m for m in ('vllm', 'pluggy', 'wrapt', 'torch') if m in sys.modules))")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.requires_patch("allocator")
def test_apply_is_idempotent_and_revert_restores_originals():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    orig_alloc = _raw(KVCacheManager, "allocate_slots")
    orig_sched = _raw(Scheduler, "schedule")
    first = activation.activate({**ON, "KVGUARD_PATCHES": "allocator"})
    assert first["distributed"].startswith("applied")        # always on: carries the flags
    assert {k: v for k, v in first.items() if k != "distributed"} == {"allocator": "applied"}
    wrapper = _raw(KVCacheManager, "allocate_slots")
    assert is_wrapped(wrapper) and wrapper.__wrapped__ is orig_alloc
    # A second activation, and a second apply() of the same patch, change nothing.
    assert activation.activate({**ON, "KVGUARD_PATCHES": "allocator"}) is first
    assert BY_NAME["allocator"].apply() == []
    assert _raw(KVCacheManager, "allocate_slots") is wrapper
    assert sorted(set(activation.wrapped_targets()) - distributed.TARGETS) == [
        "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
        "vllm.v1.core.sched.scheduler.Scheduler.schedule"]
    activation.deactivate()
    assert _raw(KVCacheManager, "allocate_slots") is orig_alloc
    assert _raw(Scheduler, "schedule") is orig_sched
    assert activation.wrapped_targets() == []


@pytest.mark.requires_patch("allocator")
def test_second_copy_of_a_patch_does_not_double_wrap():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    activation.activate({**ON, "KVGUARD_PATCHES": "allocator"})
    wrapper = _raw(KVCacheManager, "allocate_slots")
    twin = Patch(name="allocator-twin", summary="", vllm_versions=">=0",
                 targets=list(BY_NAME["allocator"].targets), upstream=(), remove_when="")
    twin.apply()
    assert _raw(KVCacheManager, "allocate_slots") is wrapper
    twin.revert()
    assert _raw(KVCacheManager, "allocate_slots") is wrapper


def test_out_of_range_patch_failing_its_self_test_is_skipped_with_one_info_line(
        monkeypatch, kvguard_log):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_kvguard import verify

    def fails():
        raise verify.SelfTestFailed("rollback left a block behind")

    monkeypatch.setattr(BY_NAME["allocator"], "vllm_versions", "<0.1")
    monkeypatch.setitem(verify.CHECKS, "allocator", fails)
    res = activation.activate({**ON, "KVGUARD_PATCHES": "allocator"})
    assert res["allocator"] == "skipped: self-test failed: rollback left a block behind"
    assert not is_wrapped(_raw(KVCacheManager, "allocate_slots"))
    skip_lines = [m for m in kvguard_log.lines(logging.INFO) if "patch 'allocator'" in m]
    assert len(skip_lines) == 1 and "rollback left a block behind" in skip_lines[0]
    warnings = kvguard_log.lines(logging.WARNING)
    assert len(warnings) == 1 and "not applied: allocator (self-test failed" in warnings[0]


def test_force_applies_out_of_range_patch(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(BY_NAME["allocator"], "vllm_versions", "<0.1")
    res = activation.activate({**ON, "KVGUARD_PATCHES": "allocator", "KVGUARD_FORCE": "1"})
    assert res["allocator"] == "applied (forced outside its range)"
    assert is_wrapped(_raw(KVCacheManager, "allocate_slots"))


@pytest.mark.requires_patch("allocator")
def test_startup_report_is_one_line_naming_version_and_patches(kvguard_log):
    import vllm.ray.ray_env  # noqa: F401
    import vllm.v1.core.kv_cache_manager  # noqa: F401  (loaded, so wrapped at once)
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401

    activation.activate({**ON, "KVGUARD_PATCHES": "allocator"})
    lines = [m for m in kvguard_log.lines(logging.INFO) if "active in" in m]
    assert len(lines) == 1 and len(lines[0]) < 200, lines
    assert "vLLM 0." in lines[0] and "on: allocator;" in lines[0]
    assert "off: warmup, cudagraph, admission, containment, health (not chosen)" in lines[0]
    assert lines[0].endswith("; distributed always on"), lines[0]
    counts = [m for m in kvguard_log.lines(logging.DEBUG) if "targets wrapped" in m]
    assert counts == ["vllm-kvguard: 6 targets wrapped, 0 more when vLLM loads their module; "
                      + activation.declared_changes()]
    assert not any("targets wrapped" in m for m in kvguard_log.lines(logging.INFO))


def test_register_never_raises(monkeypatch, kvguard_log):
    import vllm_kvguard

    def boom(env=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(activation, "activate", boom)
    vllm_kvguard.register()          # must not raise
    assert any("internal error while activating" in m for m in kvguard_log.lines(logging.ERROR))


def test_bad_flags_are_logged_and_plugin_stays_off(kvguard_log):
    assert activation.activate({"KVGUARD": "maybe"}) is None
    assert any("KVGUARD='maybe'" in m for m in kvguard_log.lines(logging.WARNING))
    assert activation.wrapped_targets() == []


# ------------------------------------------------------------------------------ fail open
class _RaisingFaultHook:
    calls = 0

    @hookimpl(tryfirst=True)
    def kvguard_inject_fault(self, pool, num_blocks):
        type(self).calls += 1
        raise KeyError("bug in a hookimpl")


@pytest.fixture
def block_pool():
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=10, enable_caching=False, hash_block_size=16)


def test_exception_in_wrapper_leaves_original_behaviour(block_pool, kvguard_log):
    res = activation.activate({**ON, "KVGUARD_PATCHES": "none", "KVGUARD_FAULTS": "every=1000"})
    assert {k: v for k, v in res.items() if k != "distributed"} == {"faults": "applied"}
    bad = _RaisingFaultHook()
    manager.register(bad, "test.raising")
    try:
        free = block_pool.get_num_free_blocks()
        blocks = block_pool.get_new_blocks(2)          # our hook raises: vLLM's result anyway
        assert len(blocks) == 2 and block_pool.get_num_free_blocks() == free - 2
        blocks += block_pool.get_new_blocks(1)
        assert block_pool.get_num_free_blocks() == free - 3
    finally:
        manager.unregister("test.raising")
    errors = [m for m in kvguard_log.lines(logging.ERROR) if "internal error in patch" in m]
    assert len(errors) == 1 and "'faults'" in errors[0] and "KeyError" in errors[0]
    assert _RaisingFaultHook.calls == 1          # tripped: later calls bypass our code


def test_host_errors_propagate_unchanged(block_pool):
    activation.activate({**ON, "KVGUARD_PATCHES": "none", "KVGUARD_FAULTS": "every=1000"})
    with pytest.raises(ValueError, match="Cannot get 100 free blocks"):
        block_pool.get_new_blocks(100)


def test_error_after_host_call_returns_host_result_without_rerunning():
    calls = []

    def host(x):
        calls.append(x)
        return x * 2

    @hooked("test-after")
    def wrapper(call: HostCall):
        call()
        raise RuntimeError("post-processing bug")

    assert wrapper(host, None, (21,), {}) == 42
    assert calls == [21]


# ------------------------------------------------------------------------------ also_at
def test_names_imported_by_value_are_patched_at_every_site(monkeypatch):
    src = types.ModuleType("kvg_src")
    exec("def f(x):\n    return x + 1\n", src.__dict__)
    user = types.ModuleType("kvg_user")
    user.f = src.f
    monkeypatch.setitem(sys.modules, "kvg_src", src)
    monkeypatch.setitem(sys.modules, "kvg_user", user)

    @hooked("test-also-at")
    def plus_ten(call: HostCall):
        return call() + 10

    patch = Patch(name="t", summary="", vllm_versions=">=0", upstream=(), remove_when="",
                  targets=[Target("kvg_src", "f", plus_ten, also_at=("kvg_user",))])
    original = src.f
    patch.apply()
    assert src.f(1) == 12 and user.f(1) == 12 and user.f is src.f
    patch.revert()
    assert src.f is original and user.f is original


def test_targets_of_unloaded_modules_wrap_when_vllm_imports_them(monkeypatch):
    assert "kvg_late" not in sys.modules
    calls = []

    @hooked("test-late")
    def tag(call: HostCall):
        calls.append(call.args)
        return call()

    patch = Patch(name="late", summary="", vllm_versions=">=0", upstream=(), remove_when="",
                  targets=[Target("kvg_late", "f", tag)])
    notes = patch.apply()
    assert notes == ["1 target(s) wrapped when vLLM imports their module"]
    late = types.ModuleType("kvg_late")
    exec("def f(x):\n    return x * 3\n", late.__dict__)
    monkeypatch.setitem(sys.modules, "kvg_late", late)
    import wrapt

    wrapt.notify_module_loaded(late)        # what the import system does for a real import
    assert is_wrapped(late.f) and late.f(2) == 6 and calls == [(2,)]
    patch.revert()
    assert not is_wrapped(late.f)


def test_missing_required_target_fails_apply_with_its_name():
    import vllm.v1.core.kv_cache_manager  # noqa: F401  (a loaded module is checked at once)

    patch = Patch(name="t", summary="", vllm_versions=">=0", upstream=(), remove_when="",
                  targets=[Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.no_such",
                                  lambda w, i, a, k: w(*a, **k))])
    with pytest.raises(LookupError, match="KVCacheManager.no_such"):
        patch.apply()
    assert not patch.applied


@pytest.mark.requires_patch("allocator")
def test_every_patch_exports_its_counters_on_vllms_registry():
    """Not only cudagraph: any activated patch registers the collector, and a count made
    later (e.g. a rollback in EngineCore) is published for the API server's /metrics."""
    from prometheus_client import REGISTRY

    from vllm_kvguard import metrics, report

    activation.activate({**ON, "KVGUARD_PATCHES": "allocator"})
    report.count("rollback", "InjectedFault")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in REGISTRY.collect() for s in fam.samples
               if s.name.startswith("kvguard_events")}
    key = ("kvguard_events_total", (("category", "rollback"), ("reason", "InjectedFault")))
    assert samples.get(key) == 1.0
    activation.deactivate()
    assert metrics._state["collector"] is None


# ------------------------------------------------------------------------------ run-time changes
def _runtime_patch(monkeypatch):
    mod = types.ModuleType("kvg_rt")
    exec("class Owner:\n"
         "    def method(self):\n        return 'class'\n"
         "    def __init__(self):\n        self._items = {'k': [1, 2]}\n"
         "GLOBAL = 'original'\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, "kvg_rt", mod)
    attr = InstanceAttr("kvg_rt", "Owner", "method", "test")
    glob = ModuleGlobal("kvg_rt", "GLOBAL", "test")
    item = ContainerItem("kvg_rt", "Owner", "_items", "test")
    patch = Patch(name="rt", summary="", vllm_versions=">=0", upstream=(), remove_when="",
                  targets=[], changes=(attr, glob, item),
                  uses=(Private("kvg_rt", "Owner", ("_items",)),))
    return mod, patch, attr, glob, item


def test_runtime_changes_are_listed_and_reverted_exactly(monkeypatch):
    mod, patch, attr, glob, item = _runtime_patch(monkeypatch)
    a, b = mod.Owner(), mod.Owner()
    before = (dict(vars(a)), mod.GLOBAL, list(a._items["k"]))
    patch.apply()
    assert attr.set(a, lambda: "instance") and a.method() == "instance"
    assert b.method() == "class" and attr.get(a) is not None and attr.get(b) is None
    assert glob.replace("stand-in") and mod.GLOBAL == "stand-in"
    assert glob.original() == "original"
    gate = object()
    item.insert(a, 1, gate, path=("k",))
    assert a._items["k"] == [1, gate, 2]
    kinds = sorted(kind for kind, _name, _obj in patch.inventory())
    assert kinds == ["container item", "instance attribute", "module global"]
    patch.revert()
    assert (dict(vars(a)), mod.GLOBAL, list(a._items["k"])) == before
    assert patch.inventory() == [] and a.method() == "class"


def test_an_instance_value_not_ours_is_left_alone(monkeypatch):
    mod, patch, attr, _glob, _item = _runtime_patch(monkeypatch)
    a = mod.Owner()
    a.method = theirs = lambda: "theirs"
    patch.apply()
    assert not attr.set(a, lambda: "ours") and a.method is theirs
    patch.revert()
    assert a.method is theirs


def test_a_dead_object_leaves_the_ledger(monkeypatch):
    import gc

    mod, patch, attr, _glob, item = _runtime_patch(monkeypatch)
    patch.apply()
    a = mod.Owner()
    attr.set(a, lambda: "x")
    item.insert(a, 0, object(), path=("k",))
    del a
    gc.collect()
    assert patch.inventory() == []
    patch.revert()


def test_drift_names_missing_change_sites_and_private_names(monkeypatch):
    mod, patch, *_ = _runtime_patch(monkeypatch)
    assert patch.drift() == []
    del mod.GLOBAL
    mod.Owner.__init__ = lambda self: None          # no _items any more
    # the change site and the private name are the same name: reported once
    assert sorted(patch.drift()) == ["kvg_rt.GLOBAL", "kvg_rt.Owner._items"]
