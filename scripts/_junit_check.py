"""Fail unless a pytest JUnit XML shows that every test ran and passed.

    python scripts/_junit_check.py RESULT.xml [--min-tests N] [--allow-skip REGEX]

Exit 0 when the file holds at least N test cases (default 1), none failed or
errored, and every skipped one's message matches REGEX (default: no skip is
allowed: on a GPU machine a skipped GPU test is a test that did not run).
Prints one summary line; the offending tests' names and messages go first.
Used by scripts/gpu_check.sh; needs only the standard library.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET


def check(path: str, min_tests: int = 1, allow_skip: str | None = None) -> tuple[bool, str]:
    """(ok, summary) for one JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return False, f"{path}: no readable JUnit XML ({e})"
    allowed = re.compile(allow_skip) if allow_skip else None
    passed, bad, skipped_ok = 0, [], 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            passed += 1
            continue
        message = (outcome.get("message") or outcome.text or "").strip().splitlines()
        message = message[0] if message else ""
        if outcome.tag == "skipped" and allowed is not None and allowed.search(message):
            skipped_ok += 1
            continue
        bad.append(f"{outcome.tag.upper()} {name}: {message[:300]}")
    total = passed + skipped_ok + len(bad)
    for line in bad:
        print(line)
    ok = not bad and total >= min_tests
    summary = (f"{path}: {total} tests, {passed} passed, {skipped_ok} allowed skips, "
               f"{len(bad)} failed/errored/skipped" + ("" if total >= min_tests else
                                                       f"; fewer than {min_tests} tests"))
    return ok, ("OK " if ok else "FAIL ") + summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml")
    ap.add_argument("--min-tests", type=int, default=1)
    ap.add_argument("--allow-skip", default=None, help="regex of skip messages that are fine")
    args = ap.parse_args(argv)
    ok, summary = check(args.xml, args.min_tests, args.allow_skip)
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
