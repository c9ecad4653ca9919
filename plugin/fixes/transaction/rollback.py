"""Transactional ``KVCacheManager.allocate_slots``: a half-done allocation is undone.

vLLM checks the block budget once and then allocates group by group; when one group's
estimate is wrong (Mamba align on external tokens, vllm#46892) or anything else raises
half-way, the error escapes ``Scheduler.schedule`` and EngineCore dies (vllm#45856).
Here the call is one transaction: read the few values of the request that the undo
cannot work out afterwards (:mod:`.plan`), empty the pool journal (:mod:`.journal`),
call vLLM; on an ``Exception`` undo everything (:mod:`.undo`) and return None, vLLM's
own "no room now", so the scheduler preempts or waits. ``allocate_slots``' own argument
check and ``BaseException`` re-raise vLLM's error untouched. When the undo itself fails,
the request's state is unknown: only that request is ended (after the step's
``schedule``, through vLLM's error path, its blocks out of the prefix cache), the blocks
the call popped that no table of it holds go back to the pool.

Most calls need no record: when the pool's free count is at least what the call can take
(:func:`.plan.fast_bound`, a few integer operations on vLLM's own arguments), "out of
blocks" cannot happen and vLLM runs with no record (the fast path). Any other exception
there has nothing to undo from: it takes the failed-undo path above (the request is
ended, stray blocks go back; counted as ``fast_path_fault``), and an "out of blocks"
there is our bug, logged with the bound. While the fault injector is on
(``KVGUARD_FAULTS``) every call records: its faults need the record.

The reads are written out per record shape (:data:`TRANSACTION`, compiled once per
shape) because a hand-written loop over the groups cannot come within one point of them:
with the loop, ``bench_allocator.py --instructions`` counted 1.052x unpatched and
``bench_scheduler.py`` 1.026x; written out, 1.032x and 1.020x (vLLM 0.32.0, full
attention + Mamba align, five and three heap layouts).
"""
from __future__ import annotations

import functools
import logging
import types
import weakref

from vllm_kvguard import report
from vllm_kvguard.fixes.transaction.journal import PoolJournal, popped
from vllm_kvguard.fixes.transaction.plan import Plan, call_bound, unsupported_reason
from vllm_kvguard.fixes.request_errors import end_request
from vllm_kvguard.fixes.transaction.undo import (RollbackFailed, failing_group, orphans, raised_by_itself,
                                     rollback)
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once

__all__ = ["Rollback", "RollbackFailed"]

#: The transaction, compiled once per record shape and run with one manager's names
#: (:meth:`Rollback.transaction`). ``{params}`` are vLLM's own parameters and ``{forward}``
#: passes them on (:attr:`.plan.Plan.signature`: no ``*args``/``**kwargs`` to build per
#: call); ``{reads}`` are :attr:`.plan.Plan.reads`: the reads written out, because as a
#: loop over the groups they cost more than the one point of instructions a hand-written
#: form may cost (see the module docstring); ``{values}`` the locals they set, made a
#: tuple only when the call failed; ``{fast}`` is :data:`FAST` or nothing.
TRANSACTION = """\
def allocate_slots({params}):
    if log:
        log.clear()                             # the journal now logs this call only
{fast}    try:
        rid = request.request_id
{reads}
    except Exception as exc:                    # fail open: rollback off, vLLM's call
        disable(exc)
        return fn({forward})
    try:
        return fn({forward})
    except Exception as error:
        return recover(plan, ({values},), list(log), rid, request, error)
"""
#: The fast path (:attr:`.plan.Plan.fast`): ``{tokens}`` its terms, vLLM's own parameters;
#: ``queue`` the pool's free queue, whose ``num_free_blocks`` is read as an attribute (its
#: ``__dict__`` is never read: on CPython 3.11 that materialises it, and every later load
#: of its attributes, in vLLM's own queue code too, goes the slow way). A call of at most
#: ``{small}`` tokens (every decode) needs ``{small_need}`` free blocks, two comparisons of
#: small ints (each followed by its jump, so CPython 3.11 specialises it); a longer one the
#: bound multiplied out by the block size (no ``//``, which
#: CPython 3.11 does not specialise): ``free * block >= tokens * groups + spare * block``
#: (the products are new int objects: about 900 more instructions a call, counted by
#: ``bench_allocator.py``). While calls find that much room (``room == 2``) the pool's
#: ``touch`` and ``_insert_block_hash`` seams are off (:meth:`.journal.PoolJournal.cool`,
#: about 0.6 % of the replay); a call that records puts them back first (``heat``), so a
#: pool that swings near full (between the two bounds) keeps them on, with no churn.
FAST = """\
{big}    try:
        tokens = {tokens}
        if tokens <= {small} and queue.num_free_blocks >= {small_need}:
            room = 2                            # plenty: the seams may go
        elif queue.num_free_blocks * {block} >= tokens * {groups} + {spare}:
            room = 1
        else:
            room = 0
    except Exception:                           # arguments the bound cannot add: record
        room = 0
    if room:                                    # no call can run out of blocks: no record
{unrecorded}    if not journal.hot and not journal.heat():
        disable(RuntimeError("the pool's seams could not be put back"))
        return fn({forward})
"""
#: The first check of the fast path where the plan has :attr:`.plan.Plan.big`: a pool
#: with room for any call of this manager (every call, on a pool that is not near full)
#: costs one comparison, not the call's bound.
BIG = """\
    if queue.num_free_blocks >= {big}:          # room for any call of this manager
{unrecorded}"""
#: The call with room, in both checks: the seams off (``{cool}``: when), vLLM's call with
#: no record, a fault contained with no undo (:meth:`Rollback.fault`; ``{tokens}``: the
#: bound's tokens, None under the bound of any call).
UNRECORDED = """\
        if {cool}journal.hot:
            journal.cool()
        try:
            return fn({forward})
        except Exception as error:
            return fault(plan, list(log), request, error, {tokens})
"""
#: The fast path's own names (a parameter may not shadow them).
FAST_NAMES = frozenset({"queue", "journal", "tokens", "room", "fault"})
#: Tokens of a call the short check covers, in blocks of the smallest block size.
SMALL_BLOCKS = 8


@functools.lru_cache(maxsize=32)
def _compiled(reads: tuple, params: tuple, forward: tuple, fast: tuple | None = None,
              big: int | None = None):
    own = _function(_source(reads, ("request",), ()))
    taken = {p.lstrip("*").split("=")[0] for p in params} - {"", "request"}
    clash = taken & (set(own.co_names) | set(own.co_varnames) | FAST_NAMES)
    if clash:
        raise ValueError(f"allocate_slots parameter(s) {', '.join(sorted(clash))} would "
                         "shadow the transaction's own names")
    return compile(_source(reads, params, forward, fast, big), "<vllm_kvguard transaction>",
                   "exec")


def _source(reads, params, forward, fast=None, big=None) -> str:
    block = ""
    if fast is not None:
        terms, size, groups, spare = fast
        small, call = SMALL_BLOCKS * size, ", ".join(forward)
        first = "" if big is None else BIG.format(big=big, unrecorded=UNRECORDED.format(
            cool="", forward=call, tokens=None))
        block = FAST.format(tokens=" + ".join(terms), block=size, groups=groups, big=first,
                            spare=spare * size, forward=call, small=small,
                            small_need=call_bound(fast, small),
                            unrecorded=UNRECORDED.format(cool="room == 2 and ",
                                                         forward=call, tokens="tokens"))
    return TRANSACTION.format(reads="\n".join(" " * 8 + r for r in reads),
                              values=", ".join(f"v{j}" for j in range(len(reads))),
                              params=", ".join(params), forward=", ".join(forward),
                              fast=block)


def _function(source: str) -> types.CodeType:
    module = compile(source, "<vllm_kvguard transaction>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


class Rollback:
    """The rollback fix. ``seams`` maps each ``BlockPool`` seam the journal uses to the
    allocator patch's declaration that installs it on a pool."""

    def __init__(self, seams: dict, notify=None, on_disable=None, fast: bool = True):
        self.seams = seams
        self.notify = notify            # called like kvguard_allocation_rolled_back
        self.on_disable = on_disable    # called once rollback is off (drop the fast paths)
        self.fast = fast                # False: every call records (the fault injector)
        self.disabled: str | None = None
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._journals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._doomed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manager: {rid: why}

    # -- per manager
    def plan_for(self, manager) -> Plan | None:
        """The manager's plan, built on first use; None when rollback cannot cover it."""
        plan = self._plans.get(manager)
        if plan is None:
            plan = self._build(manager)
            self._plans[manager] = plan
        return plan or None

    def _build(self, manager):
        why = unsupported_reason(manager)
        managers = () if why else tuple(manager.coordinator.single_type_managers)
        journal = None
        if why is None:
            pool = managers[0].block_pool
            journal = self._journals.get(pool)
            if journal is None:
                journal = PoolJournal(pool, self.seams)
                why = journal.unsupported()
                if why is None and not journal.install():
                    why = "a BlockPool whose seams are already taken"
                if why is None:
                    self._journals[pool] = journal
        if why is not None:
            once(logging.WARNING, ("rollback-unsupported", why),
                 "vllm-kvguard: transactional allocate_slots is not available for %s; "
                 "allocation errors there are not rolled back (vLLM's behaviour)", why)
            return False
        return Plan(manager, managers, journal)

    def transaction(self, manager, fn):
        """``fn`` (vLLM's ``allocate_slots`` bound to ``manager``, or anything called
        like it) as a transaction; None when rollback cannot cover ``manager`` or is off."""
        if self.disabled:
            return None
        try:
            plan = self.plan_for(manager)
            if plan is None:
                return None
            params, forward, defaults = plan.signature
            names = dict(plan.names, fn=fn, log=plan.journal.log, plan=plan,
                         recover=self.recover, disable=self.disable,
                         queue=plan.journal.queue, journal=plan.journal,
                         fault=self.fault)
            names.update(defaults)
            exec(_compiled(plan.reads, params, forward, plan.fast if self.fast else None,
                           plan.big if self.fast else None),
                 names)
        except Exception as exc:
            self.disable(exc)
            return None
        return names["allocate_slots"]

    # -- failure
    def recover(self, plan, rec, log, rid, request, error):
        """Undo a failed call (``rec``: its flat record) and return None, or re-raise
        ``error`` (see module doc)."""
        try:
            changed = rollback(plan, plan.nest(rec), log, rid)
        except Exception as exc:
            report.count("rollback_failed", type(error).__name__)
            if self._doom(plan, log, rid, (
                    f"request {rid} failed: its KV allocation raised {type(error).__name__}: "
                    f"{error}, and undoing it raised {type(exc).__name__}: {exc}")):
                return None
            once(logging.ERROR, ("rollback-failed", type(exc).__name__),
                 "vllm-kvguard: could not roll back the failed KV allocation of request %s "
                 "(%s: %s); re-raising vLLM's error %s: %s", rid, type(exc).__name__, exc,
                 type(error).__name__, error)
            raise error from None
        if not changed and raised_by_itself(error, plan.manager):
            raise error                   # allocate_slots' own argument check: vLLM's error
        cause = type(error).__name__
        group = failing_group(plan, error)
        report.count("rollback", cause)
        once(logging.WARNING, ("rollback", cause),
             "vllm-kvguard: rolled back a half-done KV allocation of request %s (KV-cache "
             "group %s, %s: %s); the scheduler sees 'no room now' and retries later. Further "
             "rollbacks with this cause are counted (report category 'rollback'), not logged",
             rid, group, cause, error)
        if self.notify is not None:
            try:
                self.notify(manager=plan.manager, request=request, group=group, error=error)
            except Exception as exc:  # a listener's bug must not turn a rollback into a crash
                once(logging.ERROR, ("rolled-back-listener", type(exc).__name__),
                     "vllm-kvguard: a kvguard_allocation_rolled_back hook raised %s: %s",
                     type(exc).__name__, exc)
        return None

    def fault(self, plan, log, request, error, tokens):
        """A call on the fast path raised: nothing recorded, nothing to undo from. vLLM's
        own argument check re-raises as on the recorded path; anything else ends only this
        request (:meth:`_doom`) and the call is "no room now". "Out of blocks" here means
        the bound was wrong: our bug, logged with the bound (``tokens`` None: the call ran
        under the bound of any call, :attr:`.plan.Plan.big`)."""
        if raised_by_itself(error, plan.manager):
            raise error
        rid, cause = getattr(request, "request_id", None), type(error).__name__
        report.count("fast_path_fault", cause)
        if isinstance(error, ValueError) and "free blocks" in str(error):
            logger.error("vllm-kvguard: BUG: allocate_slots(request %s, %s tokens) ran "
                         "unrecorded under its bound of %d blocks and raised: %s", rid,
                         "any" if tokens is None else tokens,
                         plan.big if tokens is None else plan.bound(tokens), error)
        if self._doom(plan, log, rid, (
                f"request {rid} failed: its KV allocation raised {cause}: {error} (a call "
                "with room, run unrecorded: nothing to undo)")):
            return None
        once(logging.ERROR, ("fast-path-fault", cause),
             "vllm-kvguard: could not contain the failed KV allocation of request %s; "
             "re-raising vLLM's error %s: %s", rid, cause, error)
        raise error from None

    def _doom(self, plan, log, rid, why: str) -> bool:
        """After a failed undo, or a failure on the fast path: give back the blocks this
        call popped that no table of the request holds, and end the request after this
        step's ``schedule``. False (vLLM's error is re-raised) when even that fails."""
        try:
            held = {id(b) for m in plan.managers for b in m.req_to_blocks.get(rid, ())}
            pool = plan.journal.pool
            stray = [b for b in popped(log) if id(b) not in held and b.ref_cnt > 0]
            if stray:
                plan.manager.evict_blocks({b.block_id for b in stray})
                pool.free_blocks(stray)
            lost = orphans(pool)              # popped, then dropped before vLLM counted it
            if lost:
                pool.free_block_queue.append_n(lost)
            self._doomed.setdefault(plan.manager, {})[rid] = why
        except Exception:
            return False
        report.count("contained", "allocate_slots")
        logger.error("vllm-kvguard: %s; only this request is ended (%d stray block(s) "
                     "returned to the pool)", why, len(stray) + len(lost))
        return True

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        if not self._doomed:
            return
        for rid, why in self._doomed.pop(scheduler.kv_cache_manager, {}).items():
            try:
                end_request(scheduler, rid, why, "kv_allocation", evict=True)
            except Exception as exc:  # must not raise into vLLM's loop
                report.count("internal_error", "rollback")
                once(logging.ERROR, ("doomed-end", type(exc).__name__),
                     "vllm-kvguard: could not end request %s (%s: %s)", rid,
                     type(exc).__name__, exc)

    def disable(self, exc: Exception) -> None:
        """Fail open: an internal error turns rollback off in this process."""
        self.disabled = type(exc).__name__
        report.count("internal_error", "rollback")
        if self.on_disable is not None:
            self.on_disable()
        once(logging.ERROR, ("rollback-internal",),
             "vllm-kvguard: internal error in the allocator rollback (%s: %s); allocation "
             "errors are no longer rolled back in this process (vLLM's behaviour)",
             type(exc).__name__, exc)

    def close(self) -> None:
        """Remove every pool seam; forget plans (the patch's teardown)."""
        for journal in list(self._journals.values()):
            journal.uninstall()
        self._journals.clear()
        self._plans.clear()

    # -- the hook path (any caller, any other hookimpl registered)
    @hookimpl
    def kvguard_allocate_slots(self, manager, request, call):
        txn = self.transaction(manager, lambda *_args, **_kwargs: call())
        if txn is None:
            return call()
        return txn(*call.args, **call.kwargs)
