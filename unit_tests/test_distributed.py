"""The plugin follows vLLM into its workers: the flags travel through vLLM's own copy of
the driver's environment to Ray workers, a worker whose patches differ from the driver's
says so once, and the startup line names role, node and pid."""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys

import pytest

pytest.importorskip("vllm")

import vllm.ray.ray_env as ray_env  # noqa: E402

from vllm_kvguard import activation, process  # noqa: E402

ON = {"KVGUARD": "1"}


@pytest.fixture
def driver_env(monkeypatch):
    """A process environment with the plugin on and no driver recorded yet."""
    for name in [n for n in os.environ if n.startswith("KVGUARD")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVGUARD", "1")
    monkeypatch.setenv("KVGUARD_FAULTS", "every=7")
    return monkeypatch


def _copied() -> set[str]:
    names = ray_env.get_env_vars_to_copy(exclude_vars={"VLLM_HOST_IP"}, destination="test")
    return {n for n in names if n.startswith("KVGUARD")}


def test_every_kvguard_variable_is_copied_to_ray_workers_and_revert_stops_it(driver_env):
    assert _copied() == set()                       # vLLM alone: its prefixes only
    activation.activate()
    copied = _copied()
    assert {"KVGUARD", "KVGUARD_FAULTS", process.ENV_DRIVER} <= copied, copied
    activation.deactivate()
    assert _copied() == set()


def test_the_copy_keeps_vllm_exclusions_and_the_callers_own_names(driver_env):
    driver_env.setattr(ray_env, "RAY_NON_CARRY_OVER_ENV_VARS", {"KVGUARD_FAULTS"})
    activation.activate()
    names = ray_env.get_env_vars_to_copy(additional_vars={"MY_VAR"})
    assert "KVGUARD" in names and "MY_VAR" in names
    assert "KVGUARD_FAULTS" not in names            # the user's exclusion file wins


def test_the_importers_binding_is_wrapped_too(driver_env):
    import vllm.v1.engine.utils as engine_utils

    activation.activate()
    names = engine_utils.get_env_vars_to_copy(destination="EngineCoreActor")
    assert "KVGUARD_FAULTS" in names


def test_the_first_process_publishes_its_patches_and_a_matching_one_is_silent(
        driver_env, kvguard_log):
    res = activation.activate()
    applied = [n for n, r in res.items() if r.startswith("applied")]
    raw = os.environ[process.ENV_DRIVER]
    assert raw.startswith(",".join(applied) + ";") and f"pid {os.getpid()}" in raw
    assert process.mismatch(applied) is None
    assert not [m for m in kvguard_log.lines(logging.WARNING) if "applied" in m]
    activation.deactivate()
    assert process.ENV_DRIVER not in os.environ    # only the publisher removes it


def test_a_worker_whose_patches_differ_warns_once_naming_both_sets(driver_env, kvguard_log):
    driver_env.setenv(process.ENV_DRIVER, "allocator,warmup;API server, node head, pid 1")
    driver_env.setenv("KVGUARD_PATCHES", "allocator")
    activation.activate()
    warnings = [m for m in kvguard_log.lines(logging.WARNING) if "process that started" in m]
    assert len(warnings) == 1, warnings
    assert "applied allocator, faults, distributed but" in warnings[0]
    assert "(API server, node head, pid 1) applied allocator, warmup" in warnings[0]
    activation.deactivate()
    assert os.environ[process.ENV_DRIVER].startswith("allocator,warmup;")   # not ours


def test_a_worker_left_off_on_its_node_says_so(driver_env, kvguard_log):
    driver_env.setenv(process.ENV_DRIVER, "allocator;API server, node head, pid 1")
    driver_env.setenv("KVGUARD", "0")           # a node-local value that won
    assert activation.activate() is None
    warnings = kvguard_log.lines(logging.WARNING)
    assert any("applied no patch but the process that started it" in m for m in warnings)


@pytest.mark.parametrize("name, role", [
    ("VllmWorker-1", "worker rank 1"), ("EngineCore", "EngineCore"),
    ("EngineCore_DP1", "EngineCore DP1"), ("ApiServer_2", "API server 2"),
    ("MainProcess", "front end"), ("MainProcess", "API server")])
def test_the_startup_line_names_role_node_and_pid(driver_env, kvguard_log, name, role):
    driver_env.setattr(multiprocessing.current_process(), "name", name)
    for module in process.SERVER_MODULES:
        driver_env.delitem(sys.modules, module, raising=False)
    if role == "API server":
        driver_env.setitem(sys.modules, "vllm.entrypoints.cli.serve", sys)  # `vllm serve`
    activation.activate()
    line = next(m for m in kvguard_log.lines(logging.INFO) if "active in" in m)
    assert f"active in {name} ({role}, node {process.socket.gethostname()}, " \
           f"pid {os.getpid()}), vLLM" in line, line
