"""The shared test helpers: a missing model build script fails the test instead of skipping it."""

from __future__ import annotations

import pytest

from conftest import load_models_module


def test_missing_models_module_is_an_error():
    with pytest.raises(FileNotFoundError, match="no_such_model.py: no such model build script"):
        load_models_module("no_such_model")
