"""The cudagraph fixes as pluggy hookimpls: when each decision runs, and what it logs.

:class:`CoverageHooks` runs the startup side: opt-in capture completion before KV init,
the coverage table and padding-target checks after it, the scheduler pool's null block,
and the model runner V2 capture lock (V2 never disables capture after ``capture_model``,
V1 does, so a key mismatch would capture a new graph under load).
:class:`FallbackHooks` arms the runtime accounting after capture, suspends and resumes it
around sleep / wake-up, and counts and warns on each fallback.

Both are built by the cudagraph patch with the run-time changes it declares and the flags
they need, and registered with the plugin manager.
"""
from __future__ import annotations

import logging

from vllm_kvguard.fixes.cudagraph import coverage, planner
from vllm_kvguard.fixes.cudagraph.fallbacks import CATEGORY, FIXES, Accounting
from vllm_kvguard.fixes.cudagraph.graph_owners import is_v2_runner, owner_of
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once


def _first_rank() -> bool:
    try:
        from vllm.distributed.parallel_state import is_global_first_rank

        return bool(is_global_first_rank())
    except Exception:
        return True


class CoverageHooks:
    """Coverage audit, capture completion, padding target and V2 capture lock.

    ``capture_lock`` is the declared ``ModuleGlobal`` on
    ``vllm.compilation.monitor.cudagraph_capturing_enabled`` (absent from vLLM 0.34: there
    is no lock to switch, so nothing is done there); ``complete`` and
    ``complete_force`` are ``Flags.cudagraph_complete`` / ``cudagraph_complete_force``;
    ``capture_sizes`` the declared ``CompilationConfig`` fields completion extends.
    """

    def __init__(self, capture_lock, capture_sizes=(), complete: bool = False,
                 complete_force: bool = False):
        self.capture_lock = capture_lock
        self.capture_sizes = capture_sizes      # InstanceAttr: sizes, max size
        self.complete = complete
        self.complete_force = complete_force

    @hookimpl
    def kvguard_cudagraph_before_kv_init(self, runner, kv_cache_config, is_profiling):
        if not self.complete or is_profiling:
            return
        result = planner.complete(runner, kv_cache_config, force=self.complete_force,
                                  fields=self.capture_sizes)
        if result is None:
            return
        if result.skipped:
            logger.info("vllm-kvguard: KVGUARD_CUDAGRAPH_COMPLETE: nothing added (%s)",
                        result.skipped)
            return
        logger.info("vllm-kvguard: KVGUARD_CUDAGRAPH_COMPLETE: %d extra CUDA graphs (%d -> %d) "
                    "for decode sizes %s (%s); %s. These graphs were not in the startup memory "
                    "profile: if capture runs out of memory, lower gpu_memory_utilization",
                    result.extra_graphs, result.graphs_before, result.graphs_after,
                    planner.short(result.added), result.unit, result.summary)

    @hookimpl
    def kvguard_cudagraph_after_kv_init(self, runner, kv_cache_config, is_profiling):
        problems = coverage.check_worker_padding()
        if problems:
            once(logging.ERROR, ("padding", tuple(problems)),
                 "vllm-kvguard: CUDA-graph padding target check failed: %s. Padded rows may "
                 "write live KV blocks; run with enforce_eager=True until this is resolved",
                 "; ".join(problems))
        if is_profiling:
            return
        owner = owner_of(runner)
        if owner is None:
            return
        cov = planner.audit(owner, coverage.kv_decodes_of(runner.vllm_config, kv_cache_config))
        coverage.remember(cov)
        if not _first_rank():
            return
        level = logging.INFO if cov.ok else logging.WARNING
        logger.log(level, "%s", coverage.format_table(cov))

    @hookimpl
    def kvguard_block_pool_ready(self, pool):
        problems = coverage.check_block_pool(pool)
        if problems:
            once(logging.ERROR, ("null_block", tuple(problems)),
                 "vllm-kvguard: the KV pool's null block is not reserved: %s. CUDA-graph "
                 "padding writes block 0", "; ".join(problems))

    @hookimpl
    def kvguard_cudagraph_before_capture(self, runner, profile_only):
        if is_v2_runner(runner) and self._has_lock():
            self.capture_lock.replace(True)

    def _has_lock(self) -> bool:
        from vllm_kvguard.versions import vllm_version

        return self.capture_lock.exists_in(vllm_version())

    @hookimpl
    def kvguard_cudagraph_captured(self, runner, profile_only):
        if profile_only or not is_v2_runner(runner) or not self._has_lock():
            return
        self.capture_lock.replace(False)
        once(logging.INFO, ("v2_capture_lock",),
             "vllm-kvguard: model runner V2 capture done; further CUDA-graph capture is "
             "disabled (as model runner V1 does), so a dispatch/capture key mismatch raises "
             "instead of capturing under load")

    @hookimpl
    def kvguard_cudagraph_reinit(self, worker, phase, error):
        if phase == "resume" and error is None:
            problems = coverage.check_worker_padding()
            if problems:
                once(logging.ERROR, ("padding_resume", tuple(problems)),
                     "vllm-kvguard: after wake-up the CUDA-graph padding target check "
                     "failed: %s", "; ".join(problems))


class FallbackHooks:
    """Runtime fallback accounting (:class:`~vllm_kvguard.fixes.cudagraph.fallbacks.Accounting`)."""

    def __init__(self, accounting: Accounting):
        self.accounting = accounting

    @hookimpl
    def kvguard_cudagraph_captured(self, runner, profile_only):
        if profile_only:
            return
        adapter = owner_of(runner)
        if adapter is not None:
            self.accounting.arm(runner, adapter)

    @hookimpl
    def kvguard_cudagraph_reinit(self, worker, phase, error):
        if phase == "suspend":
            self.accounting.suspend(worker)
        else:
            self.accounting.resume(worker, error)

    @hookimpl
    def kvguard_cudagraph_fallback(self, owner, reason, mode, num_tokens, detail):
        from vllm_kvguard import report

        report.count(CATEGORY, reason)       # reaches /metrics through metrics.changed
        once(logging.WARNING, (CATEGORY, reason),
             "vllm-kvguard: a batch the CUDA-graph configuration meant to graph ran %s (%s: %s). "
             "Fix: %s. Counted in kvguard_cudagraph_fallbacks_total{reason=\"%s\"}; this "
             "warning is logged once per reason", "eager" if mode == "NONE" else mode, reason,
             detail, FIXES.get(reason, "see the startup coverage table"), reason)
