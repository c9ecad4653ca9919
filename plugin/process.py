"""Who is speaking: this process's role, node and pid, and the driver's patch set.

vLLM loads the plugin in every process it starts (API server, EngineCore, each worker,
Ray actors on other nodes), so the startup line names the role, node and pid. The first
process that activates publishes its applied patches in :data:`ENV_DRIVER` (an internal
variable: processes vLLM starts inherit it, and Ray workers get it with the other
``KVGUARD*`` variables); a process whose patches differ says so once, naming both sets.
:func:`first_in_tree` does the same for lines a user needs once per process tree (a bad
flag, the release warning), through :data:`ENV_NOTED`.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import socket
import sys

ENV_DRIVER = "KVGUARD_DRIVER_PATCHES"
ENV_NOTED = "KVGUARD_TREE_NOTED"        # keys already said in this process tree
_noted_here: set[str] = set()
_WORKER_RE = re.compile(r"^VllmWorker-(\d+)$")
#: loaded in a process that serves vLLM's OpenAI API (``vllm serve`` or the module itself)
SERVER_MODULES = ("vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server")


def _ray_actor() -> tuple[str, str] | None:
    """(actor class, short node id) when this process is a Ray actor, else None."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return None
        try:
            cls = ctx.current_actor._ray_actor_creation_function_descriptor.class_name
        except Exception:       # Ray's own private detail: the role stays "Ray actor"
            cls = ""
        return cls, (ctx.get_node_id() or "")[:8]
    except Exception:
        return None


def role() -> str:
    """``API server``, ``front end``, ``EngineCore``, ``worker rank N`` or ``Ray actor ...``."""
    actor = _ray_actor()
    if actor is not None:
        return f"Ray actor {actor[0]}".rstrip()
    name = multiprocessing.current_process().name
    m = _WORKER_RE.match(name)
    if m:
        return f"worker rank {m.group(1)}"
    if name.startswith("EngineCore"):
        return "EngineCore" + (f" {name[len('EngineCore_'):]}" if "_" in name else "")
    if name.startswith("ApiServer"):
        return f"API server {name.rpartition('_')[2]}"
    if name == "MainProcess":
        return "API server" if any(m in sys.modules for m in SERVER_MODULES) else "front end"
    return name


def kind() -> str:
    """The role without its rank: ``worker`` (multiprocess or Ray), ``EngineCore``, ..."""
    r = role()
    if r.startswith("worker rank") or r == "Ray actor RayWorkerWrapper":
        return "worker"
    return r.rpartition(" ")[0] if r.startswith(("EngineCore ", "API server ")) else r


def node() -> str:
    """The host name, with the Ray node id in a Ray actor."""
    actor = _ray_actor()
    host = socket.gethostname()
    return f"{host}, Ray node {actor[1]}" if actor and actor[1] else host


def describe() -> str:
    """``<role>, node <node>, pid <pid>``: the startup line's speaker."""
    return f"{role()}, node {node()}, pid {os.getpid()}"


def _encode(patches, speaker: str) -> str:
    return f"{','.join(patches) or 'none'};{speaker}"


def _decode(raw: str) -> tuple[list[str], str]:
    names, _, speaker = raw.partition(";")
    return [n for n in names.split(",") if n and n != "none"], speaker


def publish(patches) -> bool:
    """Record this process as the driver (if none is recorded): True if it did."""
    if os.environ.get(ENV_DRIVER):
        return False
    os.environ[ENV_DRIVER] = _encode(patches, describe())
    return True


def unpublish() -> None:
    os.environ.pop(ENV_DRIVER, None)


def mismatch(patches, env=None) -> str | None:
    """The warning to log when this process's applied patches differ from the driver's."""
    raw = (os.environ if env is None else env).get(ENV_DRIVER)
    if not raw:
        return None
    driver, speaker = _decode(raw)
    if sorted(driver) == sorted(patches):
        return None
    return (f"vllm-kvguard: this process ({describe()}) applied "
            f"{', '.join(patches) or 'no patch'} but the process that started it "
            f"({speaker}) applied {', '.join(driver) or 'no patch'}; compare the KVGUARD* "
            f"variables of the two (Ray's RayExecutorV2 keeps a node's own values)")


def first_in_tree(key: str) -> bool:
    """True the first time ``key`` is asked for in this process tree (inherited through
    :data:`ENV_NOTED`, which vLLM's children and Ray workers receive): say it then only."""
    key = key.replace(",", ";")
    noted = [k for k in os.environ.get(ENV_NOTED, "").split(",") if k]
    if key in noted:
        return False
    os.environ[ENV_NOTED] = ",".join(noted + [key])
    _noted_here.add(key)
    return True


def forget_noted() -> None:
    """Drop the keys this process noted (deactivate, tests)."""
    noted = [k for k in os.environ.get(ENV_NOTED, "").split(",") if k and k not in _noted_here]
    _noted_here.clear()
    if noted:
        os.environ[ENV_NOTED] = ",".join(noted)
    else:
        os.environ.pop(ENV_NOTED, None)
