"""The one exception tree of graphopt, with the CLI exit code each kind maps to.

Messages name the file, the pass, the node (``op_type 'name'``) or the tensor and the numbers;
``hint`` is a short next step shown by the CLI under the message.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_VERIFY = 3


def first_line(exc: BaseException | str, limit: int | None = None, *, default: str | None = None) -> str:
    """The first line of an exception's message (or of a string), cut to ``limit`` characters.

    An empty message gives ``default``, else the exception's type name (``""`` for a string), so a
    message built in an ``except`` block never raises itself.
    """
    text = str(exc).strip()
    if text:
        line = text.splitlines()[0].rstrip()
    elif default is not None:
        line = default
    else:
        line = type(exc).__name__ if isinstance(exc, BaseException) else ""
    return line[:limit] if limit is not None else line


class GraphoptError(Exception):
    """Base of every error graphopt raises on purpose."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(GraphoptError):
    """Bad command-line or API usage: unknown pass, unknown option, malformed budget."""

    exit_code = EXIT_USAGE


class ModelLoadError(GraphoptError):
    """The model file is missing, empty, not ONNX, or its external data is missing."""


class MissingFileError(ModelLoadError, UsageError):
    """A file named on the command line does not exist (or is a folder): a usage error, exit 2, like
    every missing input (``--calib``, ``--recipe``, ``--tokenizer``, ``--text``, an export source)."""

    exit_code = EXIT_USAGE


class ModelSaveError(GraphoptError):
    """The output cannot be written (bad path, output equal to input, ...)."""


class OutputPathError(ModelSaveError, UsageError):
    """An output path that cannot be used, such as the input itself: a usage error (exit 2), found before any work."""

    exit_code = EXIT_USAGE


class RecipeError(UsageError):
    """A recipe file or a --passes/--set value is malformed."""


class PassError(GraphoptError):
    """A pass raised while rewriting."""


class VerificationError(GraphoptError):
    """A model failed structural or numeric verification, or a budget is not met."""

    exit_code = EXIT_VERIFY


class ExportError(GraphoptError):
    """Exporting a PyTorch / Hugging Face model to ONNX failed."""


class ParityError(ExportError):
    """The exported ONNX model does not match PyTorch within tolerance."""

    exit_code = EXIT_VERIFY


class RuntimeSetupError(GraphoptError):
    """An ONNX Runtime session could not be created (provider missing, bad model)."""
