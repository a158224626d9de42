"""Entry point: wires the command modules into one typer app and maps errors to exit codes.

Exit codes: 0 ok, 1 error, 2 usage, 3 verification failed or budget not met.
"""

from __future__ import annotations

import logging
import sys

import typer

from graphopt.cli import bench, deploy, diff, export, feeds, inspect_cmd, optimize, passes, serve, verify
from graphopt.errors import EXIT_ERROR, GraphoptError

app = typer.Typer(
    name="graphopt",
    help="Optimize ONNX transformer models for ONNX Runtime, verified pass by pass.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command("optimize", no_args_is_help=True, epilog=optimize.EPILOG)(optimize.command)
app.command("passes")(passes.command)
app.command("inspect", no_args_is_help=True)(inspect_cmd.command)
app.command("verify", no_args_is_help=True)(verify.command)
app.command("bench", no_args_is_help=True)(bench.command)
app.command("export", no_args_is_help=True)(export.command)
app.command("feeds", no_args_is_help=True)(feeds.command)
app.command("diff", no_args_is_help=True)(diff.command)
app.command("deploy", no_args_is_help=True, epilog=deploy.EPILOG)(deploy.command)
app.command("serve", no_args_is_help=True, epilog=serve.EPILOG)(serve.command)

_state = {"debug": False}


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
) -> None:
    _state["debug"] = debug
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _print_error(e: GraphoptError) -> None:
    from rich.console import Console

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    err.print(f"[bold red]error:[/] {e.message}", markup=True)
    if e.hint:
        err.print(f"[dim]hint: {e.hint}[/]", markup=True)


def _is_usage_error(e: Exception) -> bool:
    """A usage error of the click that typer (0.2x and later) vendors: it has ``show`` and an exit code,
    and is not a ``click`` exception."""
    try:
        from typer.exceptions import TyperException
    except ImportError:  # older typer raises click's own exceptions
        return False
    return isinstance(e, TyperException) and callable(getattr(e, "show", None)) and isinstance(
        getattr(e, "exit_code", None), int)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        rv = app(args=argv, standalone_mode=False)
        # with standalone_mode=False click returns the code of a raised Exit
        code = rv if isinstance(rv, int) else 0
    except GraphoptError as e:
        if debug:
            import traceback

            traceback.print_exc()
        _print_error(e)
        code = e.exit_code
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        code = EXIT_ERROR
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException) or _is_usage_error(e):
            e.show()
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
