"""Flag parsing: every bad value gives one clear line naming the flag, value and choices."""
import pytest

from vllm_kvguard.flags import PATCH_NAMES, FaultSpec, parse_faults, read_flags


@pytest.mark.parametrize("value", ["1", "on", "ON", "true", "yes"])
def test_on_values(value):
    fl = read_flags({"KVGUARD": value})
    assert fl.enabled and fl.patches == PATCH_NAMES and not fl.errors


@pytest.mark.parametrize("env", [{}, {"KVGUARD": ""}, {"KVGUARD": "0"}, {"KVGUARD": "off"}])
def test_off_values(env):
    fl = read_flags(env)
    assert not fl.enabled and not fl.errors


def test_bad_master_switch_names_value_and_choices_and_stays_off():
    fl = read_flags({"KVGUARD": "maybe"})
    assert not fl.enabled
    (err,) = fl.errors
    assert "KVGUARD='maybe'" in err and "1, on, 0, off" in err and "stays off" in err


def test_unknown_patch_name_applies_only_valid_ones():
    fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator,bogus"})
    assert fl.patches == ("allocator",)
    (err,) = fl.errors
    assert "bogus" in err and "allocator, warmup, cudagraph, admission" in err
    assert err.endswith("applying: allocator")


def test_patches_none_selects_nothing_without_error():
    fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    assert fl.patches == () and not fl.errors


def test_empty_patch_list_is_an_error():
    fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": " , "})
    assert fl.patches == () and "(empty)" in fl.errors[0]


def test_cudagraph_complete_force():
    fl = read_flags({"KVGUARD": "1", "KVGUARD_CUDAGRAPH_COMPLETE": "force"})
    assert fl.cudagraph_complete and fl.cudagraph_complete_force and not fl.errors
    fl = read_flags({"KVGUARD": "1", "KVGUARD_CUDAGRAPH_COMPLETE": "on"})
    assert fl.cudagraph_complete and not fl.cudagraph_complete_force


@pytest.mark.parametrize("name", ["KVGUARD_FORCE", "KVGUARD_AUDIT", "KVGUARD_CUDAGRAPH_COMPLETE"])
def test_bad_boolean_flags_name_themselves(name):
    fl = read_flags({"KVGUARD": "1", name: "perhaps"})
    assert fl.enabled
    assert any(e.startswith(f"{name}='perhaps'") for e in fl.errors)


def test_faults_parse():
    assert parse_faults("every=7") == FaultSpec(every=7)
    assert parse_faults("rate=0.25,seed=3,after=10,limit=2") == FaultSpec(
        rate=0.25, seed=3, after=10, limit=2)
    assert parse_faults("every=7").phase == "allocator"            # the old syntax
    assert parse_faults("phase=lookup,every=5") == FaultSpec(every=5, phase="lookup")


@pytest.mark.parametrize("raw,needle", [
    ("often", "key=value"), ("every=x", "not a number"), ("rate=2", "0<=rate<=1"),
    ("seed=1", "never fires"), ("colour=red", "every, rate, seed, after, limit"),
    ("phase=disk,every=2", "allocator, lookup, update, load"),
])
def test_bad_faults_are_reported_and_off(raw, needle):
    fl = read_flags({"KVGUARD": "1", "KVGUARD_FAULTS": raw})
    assert fl.faults is None
    assert any(needle in e and "KVGUARD_FAULTS" in e for e in fl.errors)


def test_liveness_steps():
    assert read_flags({"KVGUARD_LIVENESS_STEPS": "5"}).liveness_steps == 5
    fl = read_flags({"KVGUARD_LIVENESS_STEPS": "0"})
    assert fl.liveness_steps == 64 and "KVGUARD_LIVENESS_STEPS='0'" in fl.errors[0]


def test_minus_name_turns_one_patch_off():
    fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "-cudagraph"})
    assert fl.patches == tuple(n for n in PATCH_NAMES if n != "cudagraph") and not fl.errors
    fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "-cudagraph,-bogus"})
    assert "cudagraph" not in fl.patches and "bogus" in fl.errors[0]


def test_admission_without_warmup_says_it_refuses_nothing():
    """The door's limits come from the warmup patch's scheduler wrapper: chosen alone, the
    door would admit everything; the warning names the flag and the setting that works."""
    for raw in ("admission", "-warmup"):
        fl = read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": raw})
        assert "admission" in fl.patches and "warmup" not in fl.patches
        assert any("admission without warmup refuses nothing" in e and
                   "KVGUARD_PATCHES=warmup,admission" in e for e in fl.errors), fl.errors
    assert not read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "warmup,admission"}).errors
    assert not read_flags({"KVGUARD": "1", "KVGUARD_PATCHES": "-warmup",
                           "KVGUARD_ADMISSION": "off"}).errors


def test_faults_without_kvguard_say_they_do_nothing():
    fl = read_flags({"KVGUARD_FAULTS": "every=7"})
    (err,) = fl.errors
    assert not fl.enabled and fl.faults is None
    assert "KVGUARD_FAULTS='every=7' does nothing while KVGUARD is off" in err


def test_a_bad_flag_is_warned_once_per_process_tree(kvguard_log):
    import logging
    import os

    from vllm_kvguard import activation, process

    env = {"KVGUARD": "1", "KVGUARD_PATCHES": "allocator,bogus"}
    activation.activate(env)
    noted = os.environ[process.ENV_NOTED]
    activation.deactivate()                 # a child process: inherits the environment
    os.environ[process.ENV_NOTED] = noted
    try:
        activation.activate(env)
    finally:
        os.environ.pop(process.ENV_NOTED, None)
    bad = [m for m in kvguard_log.lines(logging.WARNING) if "bogus" in m]
    assert len(bad) == 1, bad


def test_startup_line_is_short_names_off_patches_and_inactive_without_fixes(kvguard_log):
    import logging

    from vllm_kvguard import activation

    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "-cudagraph"})
    line, = [m for m in kvguard_log.lines(logging.INFO) if m.startswith("vllm-kvguard 0")]
    assert len(line) < 200 and " active in " in line, line
    assert "off: cudagraph (not chosen)" in line and "distributed always on" in line
    activation.deactivate()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    line = [m for m in kvguard_log.lines(logging.INFO) if m.startswith("vllm-kvguard 0")][-1]
    assert " inactive in " in line and "on: no fix" in line and len(line) < 200, line
