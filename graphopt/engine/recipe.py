"""Recipes: ordered pass steps as data (TOML), plus ``--passes`` / ``--set`` parsing.

A recipe file::

    name = "default"
    description = "every lossless pass"
    [[step]]
    pass = "cleanup"
    [[step]]
    pass = "fuse"
    options = { attention = true }
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from graphopt.engine import registry
from graphopt.errors import RecipeError, UsageError


@dataclasses.dataclass
class Step:
    """One pass with its options."""

    pass_name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Recipe:
    """An ordered list of steps."""

    name: str
    steps: list[Step]
    description: str = ""

    def pass_names(self) -> list[str]:
        return [s.pass_name for s in self.steps]

    def apply_overrides(self, overrides: Sequence[str]) -> None:
        """Apply ``PASS.KEY=VALUE`` overrides to every step running PASS."""
        for item in overrides:
            key, sep, value = item.partition("=")
            pass_name, dot, opt = key.strip().partition(".")
            if not sep or not dot or not pass_name or not opt:
                raise UsageError(f"malformed --set {item!r}", hint="write --set PASS.KEY=VALUE")
            registry.get(pass_name)  # unknown pass -> did you mean
            steps = [s for s in self.steps if s.pass_name == pass_name]
            if not steps:
                raise UsageError(
                    f"--set {item!r}: pass {pass_name!r} is not in the recipe",
                    hint="recipe passes: " + ", ".join(self.pass_names()),
                )
            for s in steps:
                s.options[opt.strip()] = value.strip()

    def build(self) -> list[registry.GraphoptPass]:
        """The passes of the recipe, built once with their options (validated by the passes).

        Every pass exists in the active registry, every option is accepted, order needs
        (``run_after``) hold; otherwise a UsageError / RecipeError.
        """
        seen: list[str] = []
        built = []
        for s in self.steps:
            p = registry.create(s.pass_name, s.options)  # unknown pass / option -> UsageError
            for dep in p.run_after:
                if dep in self.pass_names() and dep not in seen:
                    raise RecipeError(
                        f"recipe {self.name!r}: pass {s.pass_name!r} must run after {dep!r}",
                        hint="reorder the steps",
                    )
            seen.append(s.pass_name)
            built.append(p)
        return built

    def validate(self) -> None:
        """Check the recipe (see :meth:`build`) without keeping the passes."""
        self.build()


def from_dict(data: dict, name: str = "recipe") -> Recipe:
    steps_raw = data.get("step", data.get("steps"))
    if not isinstance(steps_raw, list) or not steps_raw:
        raise RecipeError(f"recipe {name!r} has no [[step]] entries")
    steps = []
    for i, s in enumerate(steps_raw):
        if not isinstance(s, dict) or "pass" not in s:
            raise RecipeError(f"recipe {name!r}: step {i + 1} has no `pass`")
        opts = s.get("options", {})
        if not isinstance(opts, dict):
            raise RecipeError(f"recipe {name!r}: step {i + 1} options must be a table")
        extra = set(s) - {"pass", "options"}
        if extra:
            raise RecipeError(f"recipe {name!r}: step {i + 1} has unknown key {sorted(extra)[0]!r}")
        steps.append(Step(str(s["pass"]), dict(opts)))
    return Recipe(str(data.get("name", name)), steps, str(data.get("description", "")))


def load(path: str | Path, provider: str = "cpu") -> Recipe:
    """Load a recipe TOML file, or a builtin recipe by name (e.g. ``default``).

    A builtin recipe may have a variant for a provider, ``NAME.PROVIDER.toml`` (``default.cuda.toml``):
    it is chosen when ``provider`` is that provider, else ``NAME.toml``.
    """
    p = Path(path)
    if not p.exists():
        builtin = builtin_names()
        if str(path) in builtin:
            files = importlib.resources.files("graphopt.recipes")
            variant = files.joinpath(f"{path}.{provider}.toml")
            chosen = variant if variant.is_file() else files.joinpath(f"{path}.toml")
            return from_dict(tomllib.loads(chosen.read_text()), str(path))
        raise RecipeError(f"recipe {str(path)!r} not found", hint="builtin recipes: " + ", ".join(builtin))
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{p}: not a valid TOML recipe: {e}") from None
    return from_dict(data, p.stem)


def builtin_names() -> list[str]:
    files = importlib.resources.files("graphopt.recipes")
    return sorted(f.name[:-5] for f in files.iterdir() if f.name.endswith(".toml") and "." not in f.name[:-5])


_PAST_INPUT = re.compile(r"^past_key_values\.\d+\.(key|value)$")
_PRESENT_OUTPUT = re.compile(r"^present\.\d+\.(key|value)$")


def is_decoder_with_past(model: ir.Model) -> bool:
    """Whether ``model`` is a causal LM with past (``attention_mask`` and ``past_key_values.N.*`` inputs,
    ``present.N.*`` outputs): its default recipe is ``decoder``."""
    ins = [v.name or "" for v in model.graph.inputs]
    return ("attention_mask" in ins and any(_PAST_INPUT.match(n) for n in ins)
            and any(_PRESENT_OUTPUT.match(v.name or "") for v in model.graph.outputs))


def default(provider: str = "cpu", model: ir.Model | None = None) -> Recipe:
    """The builtin default recipe for ``provider`` (``default.cuda.toml`` for cuda); for a causal LM with
    past (``is_decoder_with_past``) the ``decoder`` recipe."""
    if model is not None and is_decoder_with_past(model):
        return load("decoder", provider=provider)
    return load("default", provider=provider)


def from_pass_list(passes: str | Sequence[str]) -> Recipe:
    """``'a,b,c'`` -> recipe running a, b, c."""
    if isinstance(passes, str):
        passes = [p for p in passes.split(",")]
    names = [p.strip() for p in passes if p.strip()]
    if not names:
        raise UsageError("--passes is empty", hint="e.g. --passes cleanup,fuse")
    for n in names:
        registry.get(n)
    return Recipe("custom", [Step(n) for n in names])
