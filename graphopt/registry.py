"""Pass protocol and the registry: kebab-case name -> pass class.

A graphopt pass is an ``onnx_ir`` in-place pass with a few class attributes the registry reads::

    class FoldThings(GraphoptPass):
        '''Fold things into other things.'''         # first line: the one-line summary
        name = "fold-things"
        exact = True                                  # lossless: verified to atol/rtol
        emits = ("com.microsoft::Attention",)         # custom / contrib ops it may emit
        run_after = ("cleanup",)                      # order needs, checked by recipes

        def __init__(self, *, threshold: float = 0.5):   # options: keyword-only
            super().__init__()
            self.threshold = threshold

        def call(self, model): ...

Options come from recipes and ``--set PASS.KEY=VALUE``; unknown options are rejected with the list
of accepted ones, and string values are converted to the type of the option's default.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import logging
import pkgutil
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from graphopt.errors import UsageError

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[GraphoptPass]] = {}
_LOADED = False


@dataclasses.dataclass
class PassContext:
    """What the pipeline hands a pass beyond the model: target provider, feeds, budget."""

    provider: str = "cpu"
    feeds: Sequence[Mapping[str, np.ndarray]] = ()
    calib_feeds: Sequence[Mapping[str, np.ndarray]] = ()
    budget: Any = None  # graphopt.metrics.Budget
    explain: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    #: rule name -> number of rewrites, filled by rule-based passes for the report
    rule_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: a lossy pass sets False when no model it could make met the budget (it then keeps the input)
    budget_met: bool | None = None


@dataclasses.dataclass
class PassResult(ir.passes.PassResult):
    """TEMP protocol shim (issue 11): what a pass reports travels in its result."""

    notes: list[str] = dataclasses.field(default_factory=list)
    rule_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    budget_met: bool | None = None


class GraphoptPass(ir.passes.InPlacePass):
    """Base class of every graphopt pass (see the module docstring)."""

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4
    emits: ClassVar[tuple[str, ...]] = ()
    run_after: ClassVar[tuple[str, ...]] = ()
    #: for test-only passes: never listed by ``graphopt passes`` nor used in the default recipe
    hidden: ClassVar[bool] = False
    #: lossy passes: the budget verified when the user gives none (e.g. "cosine>=0.99,cosine_min>=0.97")
    default_budget: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self.context = PassContext()

    def __call__(self, model, ctx: PassContext | None = None):  # TEMP protocol shim
        if len(inspect.signature(self.call).parameters) == 2:
            return self.call(model, ctx if ctx is not None else self.context)
        return super().__call__(model)

    @classmethod
    def summary(cls) -> str:
        doc = inspect.getdoc(cls) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    @classmethod
    def options(cls) -> dict[str, Any]:
        """Option name -> default value."""
        sig = inspect.signature(cls.__init__)
        return {
            p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in sig.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def options_in_use(self) -> dict[str, Any]:
        return {k: getattr(self, k, v) for k, v in self.options().items()}


def register(cls: type[GraphoptPass]) -> type[GraphoptPass]:
    """Register a pass class under ``cls.name``; a duplicate name is an error."""
    if not cls.name or cls.name != cls.name.lower() or " " in cls.name or "_" in cls.name:
        raise ValueError(f"pass {cls.__name__} needs a kebab-case `name`, got {cls.name!r}")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        if (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"pass name {cls.name!r} registered twice ({existing.__module__}, {cls.__module__})")
    _REGISTRY[cls.name] = cls
    return cls


def load_builtin_passes() -> None:
    """Import every module of ``graphopt.rewrites`` (their ``register`` calls fill the registry)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import graphopt.rewrites as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.endswith("_test") or info.name.startswith("_"):
            continue
        importlib.import_module(f"graphopt.rewrites.{info.name}")


def all_passes(include_hidden: bool = False) -> dict[str, type[GraphoptPass]]:
    load_builtin_passes()
    return {k: v for k, v in sorted(_REGISTRY.items()) if include_hidden or not v.hidden}


def get(name: str) -> type[GraphoptPass]:
    """The pass class called ``name``; an unknown name gets a "did you mean" hint."""
    load_builtin_passes()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = sorted(n for n, c in _REGISTRY.items() if not c.hidden)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "run `graphopt passes` for the list"
        raise UsageError(f"unknown pass {name!r}", hint=hint) from None


def _convert(value: Any, default: Any, pass_name: str, key: str) -> Any:
    if not isinstance(value, str) or default is None or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise UsageError(
            f"option {pass_name}.{key}: {value!r} is not a {type(default).__name__}"
        ) from None
    return value


def create(name: str, options: Mapping[str, Any] | None = None) -> GraphoptPass:
    """Instantiate the pass ``name`` with ``options`` (unknown options are a UsageError)."""
    cls = get(name)
    accepted = cls.options()
    options = dict(options or {})
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        acc = ", ".join(sorted(accepted)) or "none"
        raise UsageError(f"pass {name!r} has no option {unknown[0]!r}", hint=f"accepted options: {acc}")
    kwargs = {k: _convert(v, accepted[k], name, k) for k, v in options.items()}
    return cls(**kwargs)
