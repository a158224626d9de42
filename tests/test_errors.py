"""graphopt.errors.first_line: one line out of any exception, never an error of its own."""

from __future__ import annotations

from graphopt.errors import first_line


def test_first_line_of_a_multiline_message():
    assert first_line(ValueError("\n  bad shape  \nTraceback ...\n")) == "bad shape"


def test_empty_message_gives_the_type_name_or_the_default():
    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(RuntimeError("  \n ")) == "RuntimeError"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError(""), default="parse failed") == "parse failed"
    assert first_line("") == ""


def test_limit_and_strings():
    assert first_line(ValueError("x" * 500), 200) == "x" * 200
    assert first_line("first\nsecond", 3) == "fir"
