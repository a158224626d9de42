"""What ``graphopt.engine.pipeline.optimize`` is asked to do: one frozen options object.

The recipe is resolved from it in one place (:meth:`OptimizeOptions.resolve_recipe`): a recipe given
as a :class:`~graphopt.engine.recipe.Recipe`, a TOML file or a builtin name; else the ``passes``
named; else the default recipe for the provider (``decoder`` for a causal LM with past); ``overrides`` (``--set PASS.KEY=VALUE``) applied on top.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from graphopt import memory
from graphopt.data.metrics import Budget, parse_budget
from graphopt.engine import recipe as recipe_mod


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """Options of one optimization run (the ``graphopt optimize`` flags, as Python values)."""

    #: a Recipe, a recipe TOML file or a builtin recipe name; None: ``passes``, else the default recipe
    recipe: recipe_mod.Recipe | str | os.PathLike | None = None
    #: pass names (comma-separated or a sequence) run as a recipe of their own, when no ``recipe`` is given
    passes: str | Sequence[str] | None = None
    #: ``PASS.KEY=VALUE`` pass options applied on top of the recipe
    overrides: Sequence[str] = ()
    #: verification feeds (input name -> array per feed); else ``calib``'s, else generated
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None
    #: folder of ``.npz`` feeds (``graphopt.data.feeds.folder``)
    calib: str | os.PathLike | None = None
    #: decoder budgets (``ppl_ratio``, ``greedy_match``): a UTF-8 text file cut into calibration and held-back
    #: windows (``graphopt.generate.quality``); None: the default held-out text
    text: str | os.PathLike | None = None
    #: tokens per calibration / held-back window of ``text`` (decoder budgets measured at that context)
    text_window: int = 64
    #: the tokenizer folder for ``text``; None: the one beside the model, else UTF-8 bytes as token ids
    tokenizer: str | os.PathLike | None = None
    #: shapes and values of inputs in generated feeds (``--input-shape`` / ``--input-value``)
    input_shapes: Mapping[str, Sequence[int]] | None = None
    input_values: Mapping[str, np.ndarray] | None = None
    #: accuracy budget of lossy passes (each one's ``default_budget`` when empty)
    budget: Budget | str | Sequence[str] | None = None
    provider: str = "cpu"
    #: verification after each pass: off, structure or numeric
    verify_level: str = "numeric"
    #: a lossy pass that fails or misses the budget keeps the model as it was and the recipe goes on
    keep_going: bool = False
    #: any rolled-back pass (lossless ones too) fails the run
    strict: bool = False
    #: memory the run may use, bytes or a size such as "12G" (``graphopt.memory.plan``; files only);
    #: None: what the system reports available
    max_memory: int | str | None = None
    #: where the before/after models of a failing pass are written
    debug_dir: str | os.PathLike | None = None
    #: passes say why expected patterns did not match
    explain: bool = False
    #: lossless passes are checked on edge feeds too (zeros, extreme magnitudes and ids, shortest and longest
    #: lengths: ``graphopt.data.feeds.edge``) when feeds are generated
    edge_feeds: bool = True
    #: the "never slower" guard (``graphopt.engine.speed_guard``): ``auto`` (when timing is cheap; what
    #: ``graphopt optimize`` runs), ``on``, ``off`` (the default here: services built on the pipeline and
    #: measuring on their own, such as ``search``, do not pay for it)
    speed_check: str = "off"

    def resolve_recipe(self, model=None) -> recipe_mod.Recipe:
        """The recipe this run follows, with ``overrides`` applied (a given Recipe object is not changed).
        The default recipe depends on ``model`` (an ``onnx_ir`` model, when given): ``decoder`` for a causal
        LM with past (``recipe.is_decoder_with_past``), else ``default``."""
        if isinstance(self.recipe, recipe_mod.Recipe):
            rec = self.recipe
            if self.overrides:
                rec = dataclasses.replace(rec, steps=[dataclasses.replace(s, options=dict(s.options))
                                                      for s in rec.steps])
        elif self.recipe is not None:
            rec = recipe_mod.load(self.recipe, provider=self.provider)
        elif self.passes:
            rec = recipe_mod.from_pass_list(self.passes)
        else:
            rec = recipe_mod.default(self.provider, model)
        if self.overrides:
            rec.apply_overrides(self.overrides)
        return rec

    def resolve_budget(self) -> Budget:
        """``budget`` parsed (an empty Budget when none was given)."""
        return self.budget if isinstance(self.budget, Budget) else parse_budget(self.budget)

    def memory_limit(self) -> int | None:
        """``max_memory`` in bytes (None: what the system reports available)."""
        if self.max_memory is None or isinstance(self.max_memory, int):
            return self.max_memory
        return memory.parse_size(self.max_memory)
