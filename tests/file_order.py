"""The order test files run in: the slowest first, so that under ``pytest-xdist --dist loadfile`` no slow file
starts last and runs alone on one worker while the others idle (longest-processing-time-first scheduling).

xdist's own reordering (``--loadscope-reorder``) sorts files by their number of tests, which puts a file of
few slow tests (a quantize search, a CLI search) near the end; ``tools/dev.sh test`` turns it off
(``--no-loadscope-reorder``) and this order applies instead. Seconds per file come from
``file_seconds.json`` (beside this module; measured with ``--junitxml`` on 2 workers); a file not listed
counts ``DEFAULT_SECONDS`` per test. Within a file the tests keep their order.

Refresh the table after a run with ``--junitxml=J.xml``::

    .venv/bin/python tests/file_order.py J.xml
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
#: seconds per test of a file the table does not list (about the suite's median file's mean)
DEFAULT_SECONDS = 0.3


def load_table(path: Path = TABLE) -> dict[str, float]:
    """``{file path relative to the repository: seconds}``; empty when the table is missing."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def order(items: list, table: dict[str, float], root: Path) -> list:
    """``items`` grouped by file, the files by their seconds, slowest first (ties: collection order)."""
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(_rel(item.path, root), []).append(item)

    def cost(name: str) -> float:
        return table.get(name, DEFAULT_SECONDS * len(by_file[name]))

    files = sorted(by_file, key=lambda name: -cost(name))  # sorted() is stable: ties keep collection order
    return [item for name in files for item in by_file[name]]


def _rel(path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


def seconds_from_junit(xml_path: str | Path) -> dict[str, float]:
    """Per-file seconds (setup, call and teardown of its tests) from a ``--junitxml`` report."""
    totals: dict[str, float] = collections.Counter()
    for case in ET.parse(xml_path).iter("testcase"):
        module = case.get("classname") or ""
        parts = module.split(".")
        # classname is the module's dotted path, plus a class name for tests in a class
        for cut in range(len(parts), 0, -1):
            name = "/".join(parts[:cut]) + ".py"
            if (Path(__file__).resolve().parent.parent / name).exists():
                totals[name] += float(case.get("time") or 0.0)
                break
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tests/file_order.py JUNIT.xml")
    TABLE.write_text(json.dumps(seconds_from_junit(sys.argv[1]), indent=0) + "\n")
    print(f"wrote {TABLE}")
