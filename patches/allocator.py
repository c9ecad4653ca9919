"""Host surface: the scheduler-side KV block allocator.

Targets
    ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``
        -> hook ``kvguard_allocate_slots`` -> :mod:`vllm_kvguard.fixes.rollback`
    ``vllm.v1.core.sched.scheduler.Scheduler.schedule``
        -> hook ``kvguard_after_schedule`` -> :mod:`vllm_kvguard.fixes.audit`,
           :mod:`vllm_kvguard.fixes.liveness`
Why
    ``allocate_slots`` checks the budget once, then mutates group by group; a wrong
    estimate for one group raises ``ValueError("Cannot get N free blocks")`` half-way and
    kills EngineCore. Requests that can never fit wait forever.
Upstream
    vllm#45856 (engine dies on "Cannot get N free blocks"), vllm#46892 (Mamba align
    external-hit under-count), vllm#35541 / vllm#39734 (never-admittable request hangs).
Versions
    0.27.1 - 0.33.x (unit suite on every pin of pins.txt). The undo replays the pool log
    with absolute ref counts and predecessor-exact free-queue reinsertion, so 0.33's change
    to how ``touch``/``free_blocks`` treat the null block (which put the free queue out of
    order under the earlier container-journal rollback) does not matter.
Remove when
    vLLM's allocate_slots is transactional (rolls back on a mid-way failure) and the
    scheduler rejects requests that can never fit.

Hot path
    ``allocate_slots`` runs once per scheduled request per step (~13 us on the reference
    CPU) and the budget for vllm-kvguard there is 5 %. A wrapt method wrapper costs ~3 us
    per call, ``HostCall`` + pluggy ~7 us, so:

    * the first call through the class-level wrapper gives that ``KVCacheManager`` an
      instance attribute ``allocate_slots`` (no descriptor binding per call); the
      patch's teardown removes all of them;
    * when the only ``kvguard_allocate_slots`` implementation carries a
      ``kvguard_direct`` factory (the rollback fix does), that attribute is the
      transaction the factory builds for this manager: the C accelerator's
      ``Transaction`` (plugin/_txn.c, when built; ``KVGUARD_PURE_PYTHON=1`` turns it
      off) or else a generated Python function with vLLM's signature; either way no
      ``HostCall``, no pluggy. Per call it only tests that no patch tripped (and the
      fix's own disabled/nesting state); whether it is still the right function is
      settled when something changes instead: registering or unregistering a hookimpl
      through :mod:`vllm_kvguard.manager` removes every fast path at once, and each
      scheduler step (the ``schedule`` wrapper) first removes a fast path whose class
      attribute is no longer this patch's wrapper (re-wrapped or reverted by someone
      else) or whose hook gained implementations (registered on pluggy directly). A
      removed fast path is rebuilt by the next call through the class-level wrapper,
      when it still applies. Otherwise, and when no factory applies, the attribute is
      the same fail-open ``hooked`` wrapper as the class-level target, and
      :class:`FirstResult` calls the implementations without pluggy's per-call
      overhead while none is a pluggy wrapper (same order and arguments as pluggy's
      firstresult call), stopping at the first one that ran vLLM's call;
    * neither the manager's nor its pool's ``__dict__`` is ever read (instance attributes
      go through ``rollback.own_attr``/``set_own_attr``): on CPython 3.11 a materialised
      instance dict de-specialises every vLLM method call and attribute load on that
      object, which cost more than the transaction itself.
"""
from __future__ import annotations

import weakref

from vllm_kvguard import registry as _registry
from vllm_kvguard.fixes.rollback import del_own_attr, own_attr, set_own_attr
from vllm_kvguard.manager import DirectHook
from vllm_kvguard.registry import HostCall, Patch, Target, first_result, hooked, is_wrapped

NAME = "allocator"
_FAST_ATTR = "allocate_slots"
_MISSING = object()


class FirstResult(DirectHook):
    """``kvguard_allocate_slots`` without pluggy's per-call overhead: the implementations
    are called (same order and arguments as pluggy's firstresult call) until one returns
    a result or runs vLLM's call (see module doc)."""

    def __init__(self, hook_name: str):
        super().__init__(hook_name, firstresult=True)

    def sole(self):
        """(pluggy's live implementation list, its sole impl, that impl's
        ``kvguard_direct`` factory) when exactly one implementation offers one; else
        None. The caller re-checks the live list on every call."""
        caller = self.current()
        impls = getattr(caller, "_hookimpls", None)
        if impls is None or self.plan is None or len(impls) != 1:
            return None
        direct = getattr(impls[0].function, "kvguard_direct", None)
        return None if direct is None else (impls, impls[0], direct)

    def __call__(self, call: HostCall, **kwargs):
        caller = self.current()
        plan = self.plan
        if plan is None:
            return first_result(caller, call, **kwargs)
        kwargs["call"] = call
        for function, argnames in plan:
            result = function(*[kwargs[a] for a in argnames])
            if result is not None or call.started:
                return result
        return call()


_allocate_hook = FirstResult("kvguard_allocate_slots")


def _allocate_core(call: HostCall):
    return _allocate_hook(call, manager=call.instance, request=call.arg(0, "request"))


_fast_wrapper = hooked(NAME)(_allocate_core)      # what each instance attribute runs
#: One entry per manager with a fast path: (weak ref to it, the class dict that held the
#: wrapper, the wrapper, pluggy's live implementation list, the list it had then).
_fast_paths: list = []


def _class_attr(cls, name):
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass), vars(klass)[name]
    return None, None


def _install_fast_path(manager, bound) -> None:
    owner_dict, attr = _class_attr(type(manager), _FAST_ATTR)
    if not (is_wrapped(attr) and getattr(attr, "_self_wrapper", None) is allocate_slots):
        return                        # a subclass override or another wrapper on top
    if own_attr(manager, _FAST_ATTR, _MISSING) is not _MISSING:
        return

    def fallback(*args, **kwargs):
        if owner_dict.get(_FAST_ATTR) is not attr:           # re-wrapped, reverted, deleted
            del_own_attr(manager, _FAST_ATTR)
            return getattr(manager, _FAST_ATTR)(*args, **kwargs)
        return _fast_wrapper(bound, manager, args, kwargs)    # other hookimpls, or tripped

    fast, impls, sole = None, None, None
    found = _allocate_hook.sole()
    if found is not None:
        impls, impl, factory = found
        sole = [impl]
        fast = factory(manager, bound, tripped=_registry._tripped, fallback=fallback)
    if fast is None:
        fast = fallback
    fast.__kvguard_fast_path__ = True
    set_own_attr(manager, _FAST_ATTR, fast)     # never via manager.__dict__ (rollback.own_attr)
    _fast_paths.append((weakref.ref(manager), owner_dict, attr, impls, sole))


def _remove(manager) -> None:
    if getattr(own_attr(manager, _FAST_ATTR), "__kvguard_fast_path__", False):
        object.__delattr__(manager, _FAST_ATTR)


def _remove_fast_paths() -> None:
    for ref, *_ in _fast_paths:
        manager = ref()
        if manager is not None:
            _remove(manager)
    _fast_paths.clear()


def _revalidate() -> None:
    """Remove the fast paths that no longer apply (once per scheduler step): the class
    attribute is not this patch's wrapper any more, or the hook's implementations changed
    behind :mod:`vllm_kvguard.manager`'s back. The next call rebuilds what still applies."""
    keep = []
    for entry in _fast_paths:
        ref, owner_dict, attr, impls, sole = entry
        manager = ref()
        if manager is None:
            continue
        if owner_dict.get(_FAST_ATTR) is not attr or (sole is not None and impls != sole):
            _remove(manager)
        else:
            keep.append(entry)
    _fast_paths[:] = keep


@hooked(NAME)
def allocate_slots(call: HostCall):
    _install_fast_path(call.instance, call.wrapped)
    return _allocate_core(call)


_after_schedule = DirectHook("kvguard_after_schedule")


@hooked(NAME)
def schedule(call: HostCall):
    if _fast_paths:
        _revalidate()
    output = call()
    _after_schedule(scheduler=call.instance, output=output)
    return output


def _setup():
    from vllm_kvguard import fixes, manager

    fixes.register_allocator_fixes()
    manager.on_registration_change(_remove_fast_paths)


def _teardown():
    from vllm_kvguard import manager
    from vllm_kvguard.fixes import rollback

    manager.on_registration_change(_remove_fast_paths, remove=True)
    _remove_fast_paths()
    rollback.uninstall_all()


PATCH = Patch(
    name=NAME,
    summary="transactional allocate_slots, liveness guard, audit mode",
    targets=[
        Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", allocate_slots),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.schedule", schedule),
    ],
    vllm_versions=">=0.27.1,<0.34",
    upstream=("vllm#45856", "vllm#46892", "vllm#35541", "vllm#39734"),
    remove_when="vLLM rolls back a half-done allocate_slots itself and rejects "
                "requests that can never fit",
    setup=_setup,
    teardown=_teardown,
)
