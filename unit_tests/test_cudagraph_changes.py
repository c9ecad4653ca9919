"""The cudagraph patch's run-time changes: declared, listed, checked and undone.

The patch is applied and armed on real vLLM objects (a V1 ``CudagraphDispatcher`` behind
vLLM's own per-step dispatch, a V2 ``CudaGraphManager`` candidate table) through its real
``capture_model`` wrapper; ``PATCH.inventory()`` must list every change and
``PATCH.revert()`` must leave each object exactly as it was.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.cudagraph import graph_owners  # noqa: E402
from vllm_kvguard.fixes.cudagraph.fallbacks import CATEGORY  # noqa: E402
from vllm_kvguard.patches import BY_NAME, cudagraph, distributed  # noqa: E402
from vllm_kvguard.tools.plan import cudagraph as planning  # noqa: E402
from vllm_kvguard.versions import vllm_version  # noqa: E402

from vllm_kvguard.testing.cg_fixtures import requires_v1, vllm_logging_configured, plan  # noqa: E402,F401  (fixture: autouse)

PATCH = cudagraph.PATCH
REPO = pathlib.Path(__file__).resolve().parent.parent


def v2_runner(manager, vc):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.__dict__.update(cudagraph_manager=manager, vllm_config=vc)
    return runner


def candidates_snapshot(manager) -> dict:
    """Each candidate list of ``manager`` (the list object) and its items (by identity)."""
    return {key: (lst, [id(d) for d in lst]) for key, lst in manager._candidates.items()}


def step(runner, per_request):
    sched = np.array(per_request, dtype=np.int32)
    runner.input_batch.num_reqs = len(per_request)
    mode, *_ = runner._determine_batch_execution_and_padding(
        num_tokens=int(sched.sum()), num_reqs=len(per_request), num_scheduled_tokens_np=sched,
        max_num_scheduled_tokens=int(sched.max()), use_cascade_attn=False)
    return mode.name


@requires_v1
def test_inventory_lists_every_change_and_revert_undoes_it():
    import vllm.v1.worker.gpu.model_runner  # noqa: F401  (targets loaded: wrapped at apply)
    import vllm.v1.worker.gpu_model_runner  # noqa: F401
    from vllm.compilation import monitor
    from vllm.v1.worker.gpu import cudagraph_utils

    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "cudagraph"})
    assert res["cudagraph"].startswith("applied")
    real_descriptor = cudagraph_utils.BatchExecutionDescriptor
    lock_before = monitor.cudagraph_capturing_enabled

    v1 = planning.plan_v1_runner(plan())
    dispatcher = v1.cudagraph_dispatcher
    assert "dispatch" not in vars(dispatcher)
    vc2 = plan("v2", mode="FULL_AND_PIECEWISE")
    manager = planning.plan_owner(vc2, "v2").obj
    manager._graphs_captured = True
    before = candidates_snapshot(manager)
    v2 = v2_runner(manager, vc2)

    for runner in (v1, v2):                      # the real wrapper arms after capture
        cudagraph.capture_model(lambda: 0, runner, (), {})
    accounting = cudagraph.fixes()["fallbacks"].accounting
    assert accounting.armed_owners() == [dispatcher, manager]

    rows = PATCH.inventory()
    kinds = {}
    for kind, name, obj in rows:
        kinds.setdefault((kind, name), []).append(obj)
    assert kinds[("instance attribute", "vllm.v1.cudagraph_dispatcher.CudagraphDispatcher."
                                        "dispatch")] == [dispatcher]
    assert kinds[("module global", "vllm.v1.worker.gpu.cudagraph_utils."
                                   "BatchExecutionDescriptor")] == [cudagraph_utils]
    assert kinds[("module global", "vllm.compilation.monitor."
                                   "cudagraph_capturing_enabled")] == [monitor]
    for attr in cudagraph.PLAN_RUNNER_ATTRS:     # the planner's stand-in runner
        assert kinds[("instance attribute",
                      f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{attr}")] == [v1]
    gates = kinds.get(("container item",
                       "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager._candidates"), [])
    if graph_owners.takes_max_query_len(type(manager)):     # 0.29+: gates are placed
        assert gates and all(obj is manager for obj in gates)
        assert sum(len(lst) for lst in manager._candidates.values()) == \
            sum(len(ids) for _lst, ids in before.values()) + len(gates)
    wrapped = [name for kind, name, _ in rows if kind == "wrapped"]
    assert any(name.endswith("initialize_kv_cache") for name in wrapped)
    assert not monitor.cudagraph_capturing_enabled             # the V2 capture lock

    assert step(v1, [4] * 130) == "NONE"                       # counted through the closure
    assert report.snapshot().get(CATEGORY) == {"over_max_capture_size": 1}

    PATCH.revert()
    assert PATCH.inventory() == []
    assert "dispatch" not in vars(dispatcher)
    assert cudagraph_utils.BatchExecutionDescriptor is real_descriptor
    assert monitor.cudagraph_capturing_enabled is lock_before
    after = candidates_snapshot(manager)
    assert after.keys() == before.keys()
    for key, (lst, ids) in before.items():
        assert after[key][0] is lst and after[key][1] == ids, key
    assert not any(attr in vars(v1) for attr in cudagraph.PLAN_RUNNER_ATTRS)
    assert set(activation.wrapped_targets()) <= distributed.TARGETS   # always on


@requires_v1
def test_a_dispatch_someone_else_replaced_is_left_alone(kvguard_log):
    vc = plan()
    owner = planning.plan_owner(vc)
    theirs = owner.obj.dispatch
    owner.obj.dispatch = theirs                  # another plugin's instance attribute
    accounting = cudagraph.build_fixes()["fallbacks"].accounting
    assert not accounting.arm(None, owner)
    assert vars(owner.obj)["dispatch"] is theirs
    assert PATCH.inventory() == []


def test_planner_platform_swap_is_declared_and_restored(monkeypatch):
    """Where vLLM detects no platform, the planner swaps in its CPU platform through the
    patch's declared module globals, and puts everything back."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    real = platforms.current_platform
    bound = [m for m in cudagraph.PLATFORM_IMPORTERS
             if getattr(sys.modules.get(m), "current_platform", None) is real]
    fake = UnspecifiedPlatform()
    monkeypatch.setattr(platforms, "_current_platform", fake)
    for m in bound:
        monkeypatch.setattr(sys.modules[m], "current_platform", fake)
    with planning._some_platform():
        names = {name for _kind, name, _obj in PATCH.inventory()}
        assert "vllm.platforms._current_platform" in names
        assert {f"{m}.current_platform" for m in bound} <= names
        assert platforms._current_platform.device_type == "cpu"
        assert all(sys.modules[m].current_platform is platforms._current_platform
                   for m in bound)
    assert platforms._current_platform is fake
    assert all(sys.modules[m].current_platform is fake for m in bound)
    assert PATCH.inventory() == []


def test_frame_walk_is_bounded():
    def target():
        return graph_owners.frame_locals(code, limit=3)

    code = test_frame_walk_is_bounded.__code__
    marker = "here"  # noqa: F841  (read from this frame)

    def deep(n):
        return target() if n == 0 else deep(n - 1)

    assert target()["marker"] == "here"                  # two frames up
    assert deep(5) is None                               # beyond the limit


def test_no_drift_on_this_vllm():
    assert BY_NAME["cudagraph"].drift(vllm_version()) == []


def test_every_declared_change_and_private_name_resolves():
    """Each change and private name the patch declares names something this vLLM has."""
    version = vllm_version()
    assert [c.name for c in PATCH.changes
            if c.required and c.exists_in(version) and c.missing()] == []
    assert [m for p in PATCH.uses for m in p.missing(version)] == []
    declared = {type(c).__name__ for c in PATCH.changes}
    assert declared == {"InstanceAttr", "ModuleGlobal", "ContainerItem"}


def test_v2_changes_are_listed_and_reverted_on_every_pin():
    """The V2 path alone (the only one from 0.34): capture arms the real manager through
    the declared descriptor stand-in and gates; revert leaves vLLM's objects as they were.
    Nothing is claimed for a change the installed vLLM does not have (V1, the capture lock
    on 0.34)."""
    from vllm.v1.worker.gpu import cudagraph_utils

    version = vllm_version()
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "cudagraph"})
    assert res["cudagraph"].startswith("applied")
    real_descriptor = cudagraph_utils.BatchExecutionDescriptor
    vc = plan("v2", mode="FULL_AND_PIECEWISE")
    manager = planning.plan_owner(vc, "v2").obj
    manager._graphs_captured = True
    before = candidates_snapshot(manager)
    cudagraph.capture_model(lambda: 0, v2_runner(manager, vc), (), {})
    assert cudagraph.fixes()["fallbacks"].accounting.armed_owners() == [manager]
    names = {name for _kind, name, _obj in PATCH.inventory()}
    assert "vllm.v1.worker.gpu.cudagraph_utils.BatchExecutionDescriptor" in names
    absent = [c.name for c in PATCH.changes if not c.exists_in(version)]
    assert not names & set(absent)
    if not planning.has_v1_runner():
        assert "vllm.compilation.monitor.cudagraph_capturing_enabled" in absent
    PATCH.revert()
    assert cudagraph_utils.BatchExecutionDescriptor is real_descriptor
    after = candidates_snapshot(manager)
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}
    assert PATCH.inventory() == []
