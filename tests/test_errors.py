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


def test_third_party_logging_is_one_line(tmp_path):
    """A library logging a traceback (onnx-ir's shape inference on a negative dimension) or a Python warning
    reaches the user as one line each; ``--debug`` keeps the traceback."""
    import subprocess
    import sys

    script = tmp_path / "log.py"
    script.write_text(
        "import logging, sys, warnings\n"
        "from graphopt.cli import main as m\n"
        "m._setup_logging(verbose=False, debug='--debug' in sys.argv)\n"
        "try:\n"
        "    raise ValueError('negative dimension -1\\nmore detail')\n"
        "except ValueError:\n"
        "    logging.getLogger('onnx_ir.passes').warning('Shape inference failed', exc_info=True)\n"
        "warnings.warn('a library warning')\n")
    err = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stderr
    lines = err.splitlines()
    assert lines[0] == "WARNING onnx_ir.passes: Shape inference failed (ValueError: negative dimension -1)"
    assert len(lines) == 2 and "a library warning" in lines[1] and "Traceback" not in err
    debug = subprocess.run([sys.executable, str(script), "--debug"], capture_output=True, text=True, check=True).stderr
    assert "Traceback" in debug
