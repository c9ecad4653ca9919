"""Drift guard: every patch target must exist in the installed vLLM, or the failure names it.

The matrix (scripts/matrix.py) runs this file on every pinned vLLM. When a release renames
or removes a target, ``test_target_resolves[<target>]`` fails with the target's name and
what to do, instead of an AttributeError deep inside vLLM at serving time; the plugin
itself skips that patch with one log line (activation catches Patch.apply's LookupError).
"""
from __future__ import annotations

import inspect
import logging
import os

import pytest

from vllm_kvguard import activation
from vllm_kvguard.patches import ALL_PATCHES, BY_NAME, distributed
from vllm_kvguard.registry import is_wrapped, resolve
from vllm_kvguard.versions import vllm_version

VERSION = vllm_version()
#: the release probe (scripts/probe.py) checks names past a patch's declared range too
PROBE = os.environ.get("KVGUARD_PROBE") == "1"
CASES = [pytest.param(patch, target, id=target.name)
         for patch in ALL_PATCHES for target in patch.targets if target.required]


def check_drift(patch, target) -> None:
    """Fail (pytest.fail) naming ``target`` if the installed vLLM lacks it or its parameters."""
    if target.name in patch.missing_targets():
        pytest.fail(f"vllm-kvguard drift: patch {patch.name!r} target {target.name} is missing "
                    f"in vLLM {VERSION} (patch declares {patch.vllm_versions}); follow the "
                    f"rename in vLLM or narrow the patch's vllm_versions", pytrace=False)
    params = getattr(target, "params", ())      # parameter names the wrapper relies on
    if params:
        _parent, _attr, original = resolve(target.module, target.qualname)
        have = list(inspect.signature(original).parameters)
        lost = [p for p in params if p not in have]
        if lost:
            pytest.fail(f"vllm-kvguard drift: patch {patch.name!r} target {target.name} changed "
                        f"signature in vLLM {VERSION}: no parameter(s) {', '.join(lost)} "
                        f"(has {', '.join(have)})", pytrace=False)


@pytest.mark.parametrize("patch,target", CASES)
def test_target_resolves(patch, target):
    if not patch.supports(VERSION) and not PROBE:
        pytest.skip(f"vLLM {VERSION} outside {patch.name}'s range {patch.vllm_versions}")
    check_drift(patch, target)


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.name)
def test_every_declared_name_resolves(patch):
    """Targets, run-time change sites (instance attributes, globals, containers) and the
    private vLLM names each patch and its fixes rely on, on this vLLM."""
    if not patch.supports(VERSION) and not PROBE:
        pytest.skip(f"vLLM {VERSION} outside {patch.name}'s range {patch.vllm_versions}")
    missing = patch.drift(VERSION)
    assert not missing, (f"vllm-kvguard drift: patch {patch.name!r} relies on names vLLM "
                         f"{VERSION} lacks: {', '.join(missing)}; follow the rename in vLLM, "
                         f"declare a version range for the name, or narrow vllm_versions")


def test_every_patch_with_targets_is_checked():
    checked = {case.values[0].name for case in CASES}
    assert "allocator" in checked
    assert checked == {p.name for p in ALL_PATCHES if any(t.required for t in p.targets)}


# --------------------------------------------------------------------- a simulated removal
ALLOCATE = "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"


@pytest.fixture
def allocate_slots_removed(monkeypatch):
    """vLLM as if a release had dropped KVCacheManager.allocate_slots."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.delattr(KVCacheManager, "allocate_slots")
    return KVCacheManager


def test_removed_target_gives_the_drift_failure_naming_it(allocate_slots_removed):
    patch = BY_NAME["allocator"]
    target = next(t for t in patch.targets if t.name == ALLOCATE)
    assert patch.missing_targets() == [ALLOCATE]
    with pytest.raises(pytest.fail.Exception) as failure:
        check_drift(patch, target)
    msg = str(failure.value)
    assert ALLOCATE in msg and "'allocator'" in msg and "missing" in msg


def test_removed_target_patch_is_skipped_with_a_log_line(allocate_slots_removed, kvguard_log):
    from vllm.v1.core.sched.scheduler import Scheduler

    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    assert res["allocator"].startswith("skipped:") and ALLOCATE in res["allocator"]
    warnings = [line for line in kvguard_log.lines(logging.WARNING) if ALLOCATE in line]
    assert len(warnings) == 1 and "'allocator'" in warnings[0] and "skipped" in warnings[0]
    # all or nothing: the target that still exists was not left wrapped either
    assert not is_wrapped(vars(Scheduler)["schedule"])
    assert not BY_NAME["allocator"].applied
    assert set(activation.wrapped_targets()) <= distributed.TARGETS   # always on


def test_other_patches_still_apply_when_one_drifted(allocate_slots_removed):
    from vllm.v1.core.block_pool import BlockPool

    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                               "KVGUARD_FAULTS": "every=1000000"})
    assert res["allocator"].startswith("skipped:")
    if not BY_NAME["faults"].supports(VERSION):
        pytest.skip(f"faults patch does not support vLLM {VERSION}")
    assert res["faults"].startswith("applied")
    assert is_wrapped(vars(BlockPool)["get_new_blocks"])
