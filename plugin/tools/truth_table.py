"""The per-version truth table: for each patch and pinned vLLM, applied or skipped (why),
and whether each upstream defect it mitigates is present there or already fixed, so a
reader sees per release what the plugin does and what it is still needed for.

    kvguard table                  # print it (build/matrix/ if there, else the shipped table)
    kvguard table --results DIR    # from another results folder
    kvguard table --proven         # the table shipped with the package (vllm_kvguard/proven.json)
    kvguard table probe --out F    # (the matrix runner, per pin)
    kvguard table write-proven --results DIR [--out F]  # (the matrix, at release)

The shipped table is :func:`load`'s data as JSON (:func:`write_proven`), so a wheel install
prints it anywhere; the live check of the installed vLLM is ``kvguard doctor``.

The result readers use the standard library only: ``scripts/matrix.py`` loads this file
by path, outside any venv.

Where the cells come from (``scripts/matrix.py`` writes ``DIR/<pin>/``):

* ``probe.json``: what activation really did in that venv with every patch selected
  (``KVGUARD=1`` plus ``KVGUARD_FAULTS``), the required targets missing there (the drift
  guard), the installed vLLM version.
* ``facts.jsonl``: facts that tests observed on real vLLM objects, recorded with
  :func:`record_defect` / :func:`record_fact` while the runner sets ``KVGUARD_FACTS_FILE``
  (outside the runner they are kept in :data:`FACTS` only)::

      from vllm_kvguard.tools.truth_table import record_defect
      record_defect("warmup", "vllm#51438", present=blocks_given < blocks_needed,
                    detail=f"{blocks_given} of {blocks_needed} blocks")

  A defect recorded by a test that then failed is shown with a ``?``.
* ``unit.xml`` / ``integration.xml``: the pin's JUnit results (totals row).
* ``conformance/conformance.json``: the conformance stage (``scripts/conformance.py``:
  vLLM's own ``tests/v1/core`` plain and with the plugin), the ``conformance`` row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FACTS_ENV = "KVGUARD_FACTS_FILE"
PIN_ENV = "KVGUARD_PIN"
DEFECT = "defect:"
#: Every fact this process recorded (also when no facts file is set).
FACTS: list[dict] = []
#: Fault injection that never fires during the probe (selects the ``faults`` patch).
_PROBE_FAULTS = "every=1000000000"


# ----------------------------------------------------------------------------- recording
def _pin() -> str:
    pin = os.environ.get(PIN_ENV)
    if pin:
        return pin
    from vllm_kvguard.versions import vllm_version

    return str(vllm_version())


def record_fact(patch: str, key: str, value, detail: str = "") -> dict:
    """Record an observed fact about ``patch`` on the installed vLLM (JSON-serializable value)."""
    from vllm_kvguard.patches import BY_NAME

    if patch not in BY_NAME:
        raise ValueError(f"record_fact: unknown patch {patch!r}; valid: {', '.join(BY_NAME)}")
    fact = {"pin": _pin(), "patch": patch, "key": key, "value": value, "detail": detail,
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]}
    json.dumps(fact)                                  # fail here, not in the reader
    FACTS.append(fact)
    path = os.environ.get(FACTS_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(fact) + "\n")
    return fact


def record_defect(patch: str, defect: str, present: bool, detail: str = "") -> dict:
    """Record whether upstream defect ``defect`` (e.g. ``"vllm#51438"``) is present here."""
    return record_fact(patch, DEFECT + defect, bool(present), detail)


# ----------------------------------------------------------------------------- probing
def probe() -> dict:
    """Activate every patch as a user would, note what happened, revert."""
    from vllm_kvguard import activation
    from vllm_kvguard.patches import ALL_PATCHES
    from vllm_kvguard.versions import vllm_version

    activation.deactivate()
    try:
        results = activation.activate({"KVGUARD": "1", "KVGUARD_FAULTS": _PROBE_FAULTS}) or {}
    finally:
        activation.deactivate()
    return {
        "pin": _pin(),
        "vllm": str(vllm_version()),
        "results": results,
        "missing": {p.name: p.missing_targets() for p in ALL_PATCHES},
    }


# ----------------------------------------------------------------------------- reading
def _junit_cases(path: Path) -> dict[str, str]:
    """{nodeid-ish "file/path.py::Class::name": passed|failed|skipped} from a JUnit file."""
    cases: dict[str, str] = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return cases
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                break
            if child.tag == "skipped":
                outcome = "skipped"
        cases[_case_key(case.get("classname", ""), case.get("name", ""))] = outcome
    return cases


def _case_key(classname: str, name: str) -> str:
    return f"{classname}.{name}"


def _nodeid_key(nodeid: str) -> str:
    """pytest node id -> the key JUnit's classname + name give (``a/b.py::C::t`` -> ``a.b.C.t``)."""
    path, _, rest = nodeid.partition("::")
    if path.endswith(".py"):
        path = path[:-3]
    return ".".join([path.replace("/", ".")] + rest.split("::"))


def junit_totals(path: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {"passed": 0, "failed": 0, "skipped": 0}
    for s in suites:
        n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        tot["passed"] += n - f - e - sk
        tot["failed"] += f + e
        tot["skipped"] += sk
    return tot


def load(results: Path) -> dict:
    """Everything the table needs from a results folder."""
    meta = {}
    try:
        meta = json.loads((results / "matrix.json").read_text())
    except (OSError, ValueError):
        pass
    pins = meta.get("pins") or sorted(p.name for p in results.iterdir() if p.is_dir())
    data = {"pins": pins, "per_pin": {}}
    for pin in pins:
        d = results / pin
        entry: dict = {"probe": None, "facts": [], "cases": {}, "totals": {},
                       "conformance": None}
        try:
            entry["conformance"] = json.loads((d / "conformance" / "conformance.json")
                                              .read_text())
        except (OSError, ValueError):
            pass
        try:
            entry["probe"] = json.loads((d / "probe.json").read_text())
        except (OSError, ValueError):
            pass
        try:
            entry["facts"] = [json.loads(line) for line in (d / "facts.jsonl").read_text()
                              .splitlines() if line.strip()]
        except (OSError, ValueError):
            pass
        for suite in ("unit", "integration"):
            entry["cases"].update(_junit_cases(d / f"{suite}.xml"))
            tot = junit_totals(d / f"{suite}.xml")
            if tot is not None:
                entry["totals"][suite] = tot
        data["per_pin"][pin] = entry
    return data


# ----------------------------------------------------------------------------- rendering
def _status_cell(probe: dict | None, patch: str) -> str:
    if probe is None:
        return "not run"
    res = probe["results"].get(patch)
    missing = probe.get("missing", {}).get(patch) or []
    if res is None:
        return "not selected"
    if res.startswith("applied"):
        return "applied" + (" (forced)" if "forced" in res else "")
    why = res[len("skipped: "):] if res.startswith("skipped: ") else res
    if missing:
        why = "missing " + ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1]
                                     for t in missing)
    elif " outside " in why:
        why = "outside " + why.split(" outside ", 1)[1].split(" (")[0]
    return f"skipped ({why})"


def _defect_cell(facts: list[dict], cases: dict[str, str]) -> str:
    if not facts:
        return "not checked"
    values = {f["value"] for f in facts}
    doubtful = any(cases.get(_nodeid_key(f["test"])) == "failed" for f in facts if f["test"])
    if len(values) > 1:
        cell = "present (some cases)"
    else:
        cell = "present" if values.pop() else "fixed"
    return cell + ("?" if doubtful else "")


def conformance_cell(rec: dict | None) -> str:
    """``passed (941 plain; 941 patched, 941 audit)`` or ``FAILED (...)``."""
    if not rec:
        return "not run"
    passes = rec.get("passes") or {}
    counts = "; ".join(f"{passes[m]['passed']} {m}" for m in ("plain", "patched", "audit")
                       if m in passes)
    if rec.get("ok"):
        return f"passed ({counts})"
    newly = sum(len(passes[m].get("newly_failing") or []) for m in passes)
    why = f"{newly} newly failing" if newly else (rec.get("problems") or ["?"])[0]
    return f"FAILED ({why}; {counts})" if counts else f"FAILED ({why})"


def _md(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def render(data: dict) -> str:
    from vllm_kvguard.patches import ALL_PATCHES

    pins = data["pins"]
    per_pin = data["per_pin"]
    head = [f"vLLM {p}" for p in pins]

    rows = [["patch", "supports"] + head]
    for patch in ALL_PATCHES:
        rows.append([patch.name, patch.vllm_versions]
                    + [_status_cell(per_pin[p]["probe"], patch.name) for p in pins])
    parts = ["Patches (what activation does with KVGUARD=1 on each pinned vLLM):", _md(rows)]

    defects: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for pin in pins:
        for f in per_pin[pin]["facts"]:
            if f["key"].startswith(DEFECT):
                defects.setdefault((f["patch"], f["key"][len(DEFECT):]), {}) \
                       .setdefault(pin, []).append(f)
    for patch in ALL_PATCHES:                       # declared but never checked: show it
        for issue in patch.upstream:
            defects.setdefault((patch.name, issue), {})
    rows = [["patch", "upstream defect"] + head]
    for (patch, defect), by_pin in sorted(defects.items(), key=lambda kv: (
            [p.name for p in ALL_PATCHES].index(kv[0][0])
            if kv[0][0] in [p.name for p in ALL_PATCHES] else 99, kv[0][1])):
        rows.append([patch, defect] + [_defect_cell(by_pin.get(p, []), per_pin[p]["cases"])
                                       for p in pins])
    parts += ["", "Upstream defects (observed by tests on real vLLM objects; "
                  "'?' = the recording test failed):", _md(rows)]

    rows = [["tests"] + head]
    for suite in ("unit", "integration"):
        if not any(per_pin[p]["totals"] for p in pins):
            break                       # the shipped table carries no suite counts
        cells = []
        for p in pins:
            t = per_pin[p]["totals"].get(suite)
            cells.append("not run" if t is None else
                         f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped")
        rows.append([suite] + cells)
    rows.append(["conformance"] + [conformance_cell(per_pin[p].get("conformance"))
                                   for p in pins])
    parts += ["", _md(rows)]
    return "\n".join(parts)


def _default_results() -> Path:
    env = os.environ.get("KVGUARD_RESULTS_DIR")
    return Path(env) if env else Path.cwd() / "build" / "matrix"


#: the proven-releases table shipped inside the package
PROVEN_FILE = Path(__file__).resolve().parent.parent / "proven.json"


def write_proven(results: Path, out: Path = PROVEN_FILE) -> dict:
    """Write the shipped table from a results folder (``scripts/matrix.py`` at release):
    :func:`load`'s data, each fact cut to what the table reads."""
    data = load(results)
    for entry in data["per_pin"].values():
        entry["facts"] = [{k: f.get(k) for k in ("patch", "key", "value", "test")}
                          for f in entry["facts"]]
        failed = {_nodeid_key(f["test"]) for f in entry["facts"] if f.get("test")}
        entry["cases"] = {k: v for k, v in entry["cases"].items() if k in failed}
    import datetime

    data["written"] = datetime.date.today().isoformat()
    Path(out).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def load_proven(path: Path = PROVEN_FILE) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "pins" in data and "per_pin" in data else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvguard table", description="Print the per-version truth table: what each "
        "patch does on each proven vLLM release (the table shipped with the package, or a "
        "results folder of scripts/matrix.py). The live check of the vLLM installed here "
        "is `kvguard doctor`.")
    ap.add_argument("command", nargs="?", default="show", choices=("show", "probe",
                                                                  "write-proven"))
    ap.add_argument("--results", type=Path, default=None,
                    help="results folder of scripts/matrix.py (default: build/matrix when it "
                         "exists, else the shipped table)")
    ap.add_argument("--proven", action="store_true",
                    help="the table shipped with the package, even where build/matrix exists")
    ap.add_argument("--out", type=Path, help="probe: write the JSON here (default: stdout); "
                                             "write-proven: default the shipped file")
    args = ap.parse_args(argv)
    if args.command == "probe":
        text = json.dumps(probe(), indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        else:
            print(text)
        return 0
    results = args.results or (None if args.proven else _default_results())
    if args.command == "write-proven":
        if results is None or not results.is_dir():
            print(f"kvguard table: no results in {results}", file=sys.stderr)
            return 2
        out = args.out or PROVEN_FILE
        data = write_proven(results, out)
        print(f"kvguard table: wrote {out} ({', '.join(data['pins'])})")
        return 0
    if results is not None and results.is_dir():
        print(render(load(results)))
        return 0
    if args.results is not None:
        print(f"kvguard table: no results in {results}", file=sys.stderr)
        return 2
    data = load_proven()
    if data is None:
        print(f"kvguard table: no shipped table ({PROVEN_FILE}) and no results in "
              f"{_default_results()}", file=sys.stderr)
        return 2
    print(f"Proven releases (shipped with vllm-kvguard, written {data.get('written', '?')}):")
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
