"""The pass protocol and the registry: kebab-case name -> pass class.

A graphopt pass is an ``onnx_ir`` in-place pass with a few class attributes the registry reads, options
given once at construction, and everything it reports returned in its result::

    class FoldThings(GraphoptPass):
        '''Fold things into other things.'''         # first line: the one-line summary
        name = "fold-things"
        exact = True                                  # lossless: verified to atol/rtol
        emits = ("com.microsoft::Attention",)         # custom / contrib ops it may emit
        run_after = ("cleanup",)                      # order needs, checked by recipes

        def __init__(self, *, threshold: float = 0.5):   # options: keyword-only, validated here
            super().__init__()
            self.threshold = threshold

        def call(self, model, ctx):                      # ctx: PassContext (read-only)
            ...
            return PassResult(model, modified, notes=[...], rule_counts={...})

A pass holds nothing between calls: ``__call__`` fails a pass that sets attributes on itself during
``call``. Options come from recipes and ``--set PASS.KEY=VALUE``; unknown options are rejected with the
list of accepted ones, and string values are converted to the type of the option's default.

The builtin passes are the modules named in ``BUILTIN_MODULES``; the builtin registry loads all of
them or fails naming the module. Tests and plug-ins use a local :class:`Registry` made active with
:func:`using`; nothing they add is visible outside that block.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import Budget, parse_budget
from graphopt.errors import GraphoptError, PassError, UsageError, first_line

#: the modules of ``graphopt.rewrites`` that define the builtin passes (one ``register`` call each)
BUILTIN_MODULES: tuple[str, ...] = ("cleanup", "fuse", "remove_padding", "quantize", "convert_precision",
                                    "prune_heads", "early_exit", "sparsify", "contextual_sparsity", "cut_positions",
                                    "merge_projections", "group_query_attention", "kv_cache_quant", "kivi_cache",
                                    "decode_sparsity", "speculative_heads", "q8_tables", "layer_skip",
                                    "implied_zero_points", "logits_to_keep")

Feed = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What the pipeline hands a pass beyond the model (read-only): target provider, feeds, budget."""

    provider: str = "cpu"
    #: feeds held back from calibration (budget checks)
    feeds: Sequence[Feed] = ()
    #: calibration feeds
    calib_feeds: Sequence[Feed] = ()
    #: the budget a lossy pass must meet, resolved once (:func:`resolve_budget`): the pipeline hands in
    #: ``--budget`` or the pass's ``default_budget``; a direct call without one gets the default
    budget: Budget | None = None
    #: False when the caller gave no budget and ``budget`` is the pass's default (a direct call: the
    #: pipeline always hands one in); a lossy pass then applies explicitly asked levels without checking
    budget_given: bool = True
    #: say why expected patterns did not match (in the result's notes)
    explain: bool = False
    #: decoder budgets (``ppl_ratio``, ``greedy_match``): the input model's perplexity and greedy tokens on
    #: the calibration and held-back text windows (``graphopt.generate.quality.DecoderCheck``), or None
    decoder: Any = None


@dataclasses.dataclass
class BudgetOutcome:
    """What a lossy pass measured against its budget: the terms, the values on the rows held back from
    calibration (``cosine``: its lower confidence bound where the pass uses one), met or not."""

    budget: str
    #: metric -> the value measured on the held-back rows (empty: the pass measured nothing itself)
    measured: dict[str, float] = dataclasses.field(default_factory=dict)
    #: None: not decided by the pass (an explicitly asked level without a budget; the pipeline verifies)
    met: bool | None = None

    def __str__(self) -> str:
        got = ", ".join(f"{k} {v:.4g}" for k, v in self.measured.items()) or "not measured by the pass"
        verdict = {True: "met", False: "not met", None: "not checked"}[self.met]
        return f"budget {self.budget}: {verdict} ({got})"


@dataclasses.dataclass
class PassResult(ir.passes.PassResult):
    """The model, whether it changed, and everything the pass reports."""

    notes: list[str] = dataclasses.field(default_factory=list)
    #: rule name -> number of rewrites
    rule_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: lossy passes: False when no model they could make met the budget (they then keep the input)
    budget_met: bool | None = None
    #: lossy passes: the budget, the cost measured on the held-back rows, met or not (``rewrites.common.lossy``)
    budget_outcome: BudgetOutcome | None = None
    #: an explicit output-contract change (a pass option the user asked for): new output name ->
    #: (old output name, axis, position); the pipeline verifies the new output against that one-position
    #: slice of the old output's reference (kept as a length-1 axis)
    sliced_outputs: dict[str, tuple[str, int, int]] = dataclasses.field(default_factory=dict)


class GraphoptPass(ir.passes.InPlacePass):
    """Base class of every graphopt pass (see the module docstring)."""

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4
    emits: ClassVar[tuple[str, ...]] = ()
    run_after: ClassVar[tuple[str, ...]] = ()
    #: lossless passes: False for one that only a model family's recipe runs (the default recipe runs every
    #: other lossless pass)
    in_default_recipe: ClassVar[bool] = True
    #: lossy passes: the budget verified when the user gives none (most: ``metrics.DEFAULT_BUDGET``);
    #: read by :func:`resolve_budget`, never parsed by the pass itself
    default_budget: ClassVar[str] = ""

    def __call__(self, model: ir.Model, ctx: PassContext | None = None) -> PassResult:  # type: ignore[override]
        """Run the pass on ``model`` (in place) and return its result.

        A lossy pass called without a budget gets its ``default_budget`` in ``ctx.budget``
        (``ctx.budget_given`` False).
        """
        ctx = PassContext() if ctx is None else ctx
        if not self.exact and not ctx.budget:
            ctx = dataclasses.replace(ctx, budget=resolve_budget(self, None), budget_given=False)
        state = dict(vars(self))
        self.requires(model)
        result = self.call(model, ctx)
        if not isinstance(result, PassResult):
            raise PassError(f"pass {self.name!r} returned {type(result).__name__}, not graphopt PassResult")
        if result.model is not model:
            raise PassError(f"pass {self.name!r} is in place but returned another model")
        written = sorted(k for k in set(vars(self)) | set(state) if vars(self).get(k, state) is not state.get(k))
        if written:
            raise PassError(f"pass {self.name!r} wrote {', '.join(written)} on itself during call(); "
                            "a pass reports through its PassResult and holds nothing between calls")
        self.ensures(model)
        return result

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:  # type: ignore[override]
        raise NotImplementedError

    @classmethod
    def summary(cls) -> str:
        return first_line(inspect.getdoc(cls) or "")

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


def _check_name(cls: type[GraphoptPass]) -> None:
    if not cls.name or cls.name != cls.name.lower() or " " in cls.name or "_" in cls.name:
        raise ValueError(f"pass {cls.__name__} needs a kebab-case `name`, got {cls.name!r}")


class Registry:
    """Pass name -> class. ``Registry(base)`` starts with every pass of ``base``."""

    def __init__(self, base: Registry | None = None) -> None:
        self._passes: dict[str, type[GraphoptPass]] = dict(base._passes) if base is not None else {}

    def add(self, cls: type[GraphoptPass]) -> type[GraphoptPass]:
        """Add a pass class under ``cls.name``; a name taken by another class is an error."""
        _check_name(cls)
        existing = self._passes.get(cls.name)
        if existing is not None and existing is not cls:
            raise ValueError(f"pass name {cls.name!r} registered twice ({existing.__module__}, {cls.__module__})")
        self._passes[cls.name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self._passes)

    def all(self) -> dict[str, type[GraphoptPass]]:
        return {k: self._passes[k] for k in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._passes

    def get(self, name: str) -> type[GraphoptPass]:
        """The pass class called ``name``; an unknown name gets a "did you mean" hint."""
        try:
            return self._passes[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "run `graphopt passes` for the list"
            raise UsageError(f"unknown pass {name!r}", hint=hint) from None

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> GraphoptPass:
        """Instantiate the pass ``name`` with ``options`` (unknown options are a UsageError)."""
        cls = self.get(name)
        accepted = cls.options()
        options = dict(options or {})
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            acc = ", ".join(sorted(accepted)) or "none"
            raise UsageError(f"pass {name!r} has no option {unknown[0]!r}", hint=f"accepted options: {acc}")
        kwargs = {k: _convert(v, accepted[k], name, k) for k, v in options.items()}
        return cls(**kwargs)


def resolve_budget(p: GraphoptPass | type[GraphoptPass], given: Budget | None) -> Budget | None:
    """The budget pass ``p`` runs under: ``given`` when it has terms, else the pass's ``default_budget``
    (a lossless pass: ``given`` as it is). Resolved once, by the pipeline (or ``GraphoptPass.__call__``
    for a direct call); passes read ``ctx.budget``."""
    if given or p.exact:
        return given
    return parse_budget(p.default_budget)


# -------------------------------------------------------------- the builtin registry

#: module name -> pass classes its ``register`` calls declared
_DECLARED: dict[str, list[type[GraphoptPass]]] = {}
_BUILTIN: Registry | None = None
_ACTIVE: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("graphopt_registry", default=None)


def register(cls: type[GraphoptPass]) -> type[GraphoptPass]:
    """Declare a builtin pass (called once at the end of its module in ``graphopt.rewrites``).

    Only classes of the modules in ``BUILTIN_MODULES`` reach the builtin registry; a test or plug-in
    pass goes into a local :class:`Registry` instead.
    """
    _check_name(cls)
    declared = _DECLARED.setdefault(cls.__module__, [])
    if cls not in declared:
        declared.append(cls)
    return cls


class PassLoadError(GraphoptError):
    """A builtin pass module failed to import (a broken install or a bug in the module)."""


def builtin() -> Registry:
    """The registry of builtin passes: every module in ``BUILTIN_MODULES`` loads, or PassLoadError."""
    global _BUILTIN
    if _BUILTIN is not None:
        return _BUILTIN
    reg = Registry()
    for mod in BUILTIN_MODULES:
        full = f"graphopt.rewrites.{mod}"
        try:
            module = importlib.import_module(full)
        except Exception as e:  # any failure of a builtin module is fatal and named
            raise PassLoadError(f"cannot load the builtin pass module {full}: {type(e).__name__}: {first_line(e)}",
                                hint="a broken install or a bug in that module; --debug shows the traceback") from e
        # a pass package may declare its passes in its submodules (``quantize.decoder_int4``)
        classes = [c for m, cs in _DECLARED.items() if m == module.__name__ or m.startswith(module.__name__ + ".")
                   for c in cs]
        if not classes:
            raise PassLoadError(f"builtin pass module {full} registers no pass")
        for cls in classes:
            reg.add(cls)
    _BUILTIN = reg
    return reg


def current() -> Registry:
    """The active registry: a local one made active by :func:`using`, else the builtin one."""
    return _ACTIVE.get() or builtin()


@contextlib.contextmanager
def using(reg: Registry) -> Iterator[Registry]:
    """Make ``reg`` the active registry inside the block (this thread / context only)."""
    token = _ACTIVE.set(reg)
    try:
        yield reg
    finally:
        _ACTIVE.reset(token)


def with_builtins(*classes: type[GraphoptPass]) -> Registry:
    """A local registry: the builtin passes plus ``classes``."""
    reg = Registry(builtin())
    for cls in classes:
        reg.add(cls)
    return reg


def all_passes() -> dict[str, type[GraphoptPass]]:
    """Every pass of the active registry, by name."""
    return current().all()


def get(name: str) -> type[GraphoptPass]:
    """The pass class ``name`` in the active registry ("did you mean" for an unknown name)."""
    return current().get(name)


def create(name: str, options: Mapping[str, Any] | None = None) -> GraphoptPass:
    """Instantiate the pass ``name`` of the active registry with ``options``."""
    return current().create(name, options)


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
