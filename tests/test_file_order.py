"""tests/file_order.py: files slowest first (measured seconds, else a per-test default), tests in file order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from file_order import DEFAULT_SECONDS, load_table, order, seconds_from_junit

ROOT = Path(__file__).resolve().parent.parent


def _items(spec):
    return [SimpleNamespace(path=ROOT / f, name=f"{f}::{i}") for f, i in spec]


def test_slowest_file_first_and_tests_keep_their_order():
    items = _items([("a_test.py", 1), ("b_test.py", 1), ("a_test.py", 2), ("c_test.py", 1), ("b_test.py", 2)])
    table = {"b_test.py": 50.0, "a_test.py": 2.0}  # c_test.py unlisted: one test's default seconds
    got = [it.name for it in order(items, table, ROOT)]
    assert got == ["b_test.py::1", "b_test.py::2", "a_test.py::1", "a_test.py::2", "c_test.py::1"]
    assert DEFAULT_SECONDS < 2.0
    # unlisted files compare by their number of tests; ties keep collection order
    got = [it.name for it in order(items, {}, ROOT)]
    assert got == ["a_test.py::1", "a_test.py::2", "b_test.py::1", "b_test.py::2", "c_test.py::1"]


def test_the_table_and_its_refresh_from_junit(tmp_path):
    assert load_table(tmp_path / "missing.json") == {}
    table = load_table()
    assert table and all(v >= 0 for v in table.values())
    assert all((ROOT / name).exists() for name in table), "a file the table lists is gone: refresh it"
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_file_order" name="a" time="1.5"/>'
                   '<testcase classname="tests.test_file_order" name="b" time="2.0"/>'
                   '<testcase classname="rewrites.common.names_test" name="c" time="0.25"/>'
                   '<testcase classname="no.such.module" name="d" time="9"/>'
                   '</testsuite></testsuites>')
    got = seconds_from_junit(xml)
    assert got == {"tests/test_file_order.py": 3.5, "rewrites/common/names_test.py": 0.2}
    assert list(got) == ["tests/test_file_order.py", "rewrites/common/names_test.py"]
