"""Entry point: wires the command modules into one typer app and maps errors to exit codes.

Exit codes: 0 ok, 1 error, 2 usage (an unknown command or option, a bad value, a missing input file or
folder), 3 verification failed or budget not met. Every failure is one ``error:`` line on stderr, with a
``hint:`` line when there is a next step.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys

import typer

from graphopt.cli import bench, deploy, diff, export, feeds, inspect_cmd, optimize, passes, serve, verify
from graphopt.errors import EXIT_ERROR, GraphoptError, first_line
from graphopt.interrupt import unwind_on_signals

app = typer.Typer(
    name="graphopt",
    help="Optimize ONNX transformer models for ONNX Runtime, verified pass by pass.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _help(fn) -> str:
    """``fn``'s docstring as help text: paragraphs kept, the line breaks inside a paragraph joined, so
    that rich rewraps it cleanly at any width (typer keeps them in every paragraph after the first)."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    return "\n\n".join(" ".join(line.strip() for line in para.splitlines()) for para in doc.split("\n\n"))


def _command(name: str, fn, **kwargs) -> None:
    app.command(name, help=_help(fn), **kwargs)(fn)


_command("optimize", optimize.command, no_args_is_help=True, epilog=optimize.EPILOG)
_command("passes", passes.command)
_command("inspect", inspect_cmd.command, no_args_is_help=True)
_command("verify", verify.command, no_args_is_help=True)
_command("bench", bench.command, no_args_is_help=True)
_command("export", export.command, no_args_is_help=True)
_command("feeds", feeds.command, no_args_is_help=True)
_command("diff", diff.command, no_args_is_help=True)
_command("deploy", deploy.command, no_args_is_help=True, epilog=deploy.EPILOG)
_command("serve", serve.command, no_args_is_help=True, epilog=serve.EPILOG)

_state = {"debug": False}


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
) -> None:
    _state["debug"] = debug
    _setup_logging(verbose=verbose, debug=debug)


class _OneLineFormatter(logging.Formatter):
    """Every log record as one line: ``LEVEL logger: message``. A record carrying an exception (a third-party
    library logging a traceback, e.g. onnx-ir's shape inference on a negative dimension) shows the exception's
    type and first line instead of the traceback; ``--debug`` keeps the traceback."""

    def __init__(self, debug: bool):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if self.debug:
            return super().format(record)
        message = " ".join(record.getMessage().split())
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            message += f" ({type(e).__name__}: {first_line(e)})"
        return f"{record.levelname} {record.name}: {message}"


def _setup_logging(*, verbose: bool, debug: bool) -> None:
    """One stderr handler for graphopt's and every library's logging, and Python warnings through it."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    if root.handlers:  # configured already (an embedding application, a test runner): as logging.basicConfig
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_OneLineFormatter(debug))
    root.addHandler(handler)
    logging.captureWarnings(True)


def _print_error(message: str, hint: str | None) -> None:
    """One ``error:`` line and an optional ``hint:`` line on stderr, never wrapped (``cli.console``)."""
    from rich.markup import escape

    from graphopt.cli.console import make_console

    err = make_console(stderr=True, soft_wrap=True)
    err.print(f"[bold red]error:[/] {escape(message)}")
    if hint:
        err.print(f"[dim]hint: {escape(hint)}[/]")


def _print_usage_error(e: Exception) -> None:
    """A click usage error (bad option, missing argument, unknown command) as the one-line error of
    every other failure, with where to find help."""
    message = e.format_message()
    if type(e).__name__ == "NoArgsIsHelpError" or not message.strip():  # no arguments: the help, as click shows it
        e.show()
        return
    ctx = getattr(e, "ctx", None)
    path = (getattr(ctx, "command_path", "") if ctx is not None else "") or "graphopt"
    _print_error(message, f"'{path} -h' for help")


def _is_usage_error(e: Exception) -> bool:
    """A usage error of the click that typer (0.2x and later) vendors: it has ``format_message`` and an
    exit code, and is not a ``click`` exception."""
    try:
        from typer.exceptions import TyperException
    except ImportError:  # older typer raises click's own exceptions
        return False
    return isinstance(e, TyperException) and callable(getattr(e, "format_message", None)) and isinstance(
        getattr(e, "exit_code", None), int)


@contextlib.contextmanager
def _help_width():
    """Without a terminal, ``--help`` is laid out at ``COLUMNS`` or HELP_PIPE_WIDTH columns instead of
    rich's 80, for this run only (typer reads ``TERMINAL_WIDTH`` once, at import; when set, it wins)."""
    from graphopt.cli.console import HELP_PIPE_WIDTH, stream_is_tty, terminal_columns

    try:
        from typer import rich_utils
    except ImportError:  # typer without rich
        yield
        return
    before = getattr(rich_utils, "MAX_WIDTH", 0)
    if before is None and not stream_is_tty(sys.stdout):
        rich_utils.MAX_WIDTH = terminal_columns() or HELP_PIPE_WIDTH
    try:
        yield
    finally:
        if before is None:
            rich_utils.MAX_WIDTH = before


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        # SIGTERM unwinds like Ctrl-C: temporary files are removed, no output is half-written
        with _help_width(), unwind_on_signals():
            rv = app(args=argv, prog_name="graphopt", standalone_mode=False)
        # with standalone_mode=False click returns the code of a raised Exit
        code = rv if isinstance(rv, int) else 0
    except GraphoptError as e:
        if debug:
            import traceback

            traceback.print_exc()
        _print_error(e.message, e.hint)
        code = e.exit_code
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        code = EXIT_ERROR
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException) or _is_usage_error(e):
            _print_usage_error(e)
            code = e.exit_code
        elif isinstance(e, click.exceptions.Exit):
            code = e.exit_code
        else:
            if debug:
                raise
            print(f"error: internal error: {type(e).__name__}: {e}", file=sys.stderr)
            print("hint: rerun with --debug for the traceback, and report it", file=sys.stderr)
            code = EXIT_ERROR
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
