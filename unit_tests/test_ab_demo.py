"""``kvguard demo``'s judgement over plain results (no engine): every failure the demo
must show is checked, and any one missing turns it into a non-zero exit."""
from vllm_kvguard.tools import demo

OUT = [[5, 6, 7], [8, 9, 10]]
REASONS = ["length", "length"]


def run(*, died=False, outputs=OUT, faults=0, held=0, rollbacks=0):
    totals = ({"submitted": 2, "completed": 0, "failed": 2, "aborted": 0} if died else
              {"submitted": 2, "completed": 2, "failed": 0, "aborted": 0})
    return {"ok": not died, "engine_died": died, "totals": totals,
            "error": "InjectedFault: injected: Cannot get 2 free blocks" if died else None,
            "outputs": None if died else outputs, "finish_reasons": None if died else REASONS,
            "held_blocks": None if died else held, "audit_violations": None if died else [],
            "faults_injected": faults,
            "kvguard": {"counters": {"rollback": {"InjectedFault": rollbacks}}}}


DOOR = {"alone": {"refused": None, "fits_refused": None},
        "with": {"refused": "vllm-kvguard: request over can never fit the KV cache: ...",
                 "fits_refused": None}}


def good():
    return dict(ref=run(), alone=run(died=True, faults=1),
                fixed=run(faults=2, rollbacks=2), door=DOOR)


def shown(**over):
    return [ok for ok, _ in demo.judge(**{**good(), **over})]


def test_all_shown():
    results = demo.judge(**good())
    assert all(ok for ok, _ in results) and len(results) == 5
    assert "2 faults injected, 2 rolled back; 0 blocks left held" in results[2][1]
    assert "2/2 token-identical" in results[2][1]


def test_each_missing_piece_is_not_shown():
    assert not shown(alone=run(faults=1))[1]                      # vLLM alone survived
    assert not shown(alone=run(died=True, faults=0))[1]           # died of something else
    assert not shown(fixed=run(died=True, faults=1))[2]           # the fixes failed
    assert not shown(fixed=run(faults=0))[2]                      # nothing was injected
    assert not shown(fixed=run(faults=2, held=3))[2]              # blocks leaked
    assert not shown(fixed=run(faults=2, outputs=[[5, 6, 7], [8, 9, 11]]))[2]   # differ
    closed = {"alone": DOOR["alone"], "with": {"refused": None, "fits_refused": None}}
    assert not shown(door=closed)[4]
    strict = {"alone": DOOR["alone"], "with": {**DOOR["with"], "fits_refused": "no room"}}
    assert not shown(door=strict)[4]
    assert shown(door={"error": "ImportError: x"}) == [True, True, True, False]


def test_the_jobs_are_the_ab_scenario_with_and_without_fixes():
    ref, alone, fixed, door = demo.jobs("every=7", False, {})
    assert ref[1] == {} and ref[0] == alone[0] == fixed[0]
    assert alone[1] == {"KVGUARD": "1", "KVGUARD_FAULTS": "every=7", "KVGUARD_PATCHES": "none"}
    assert fixed[1] == {"KVGUARD": "1", "KVGUARD_FAULTS": "every=7", "KVGUARD_AUDIT": "1"}
    assert door[0] == {"with": {"KVGUARD": "1"}} and door[2].endswith("--door-child")
    off = demo.jobs("every=7", True, {})
    assert off[2][1]["KVGUARD_PATCHES"] == "none" and off[3][0]["with"]["KVGUARD_PATCHES"] == "none"
