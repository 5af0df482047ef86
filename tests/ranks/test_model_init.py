"""runtime.ranks.model's names, imported from their modules on first use (so the
frontend and the coordinator read model directories without importing torch)."""

from __future__ import annotations

import importlib

import pytest

import runtime.ranks.model as package


@pytest.mark.parametrize("name", package.__all__)
def test_every_exported_name_is_its_modules_object(name: str) -> None:
    home = importlib.import_module(f"runtime.ranks.model.{package._HOMES[name]}")
    assert getattr(package, name) is getattr(home, name)
    assert name in dir(package)


def test_the_exports_and_their_homes_agree_and_nothing_else_resolves() -> None:
    assert set(package.__all__) == set(package._HOMES)
    with pytest.raises(AttributeError, match="no attribute 'load_everything'"):
        package.load_everything  # noqa: B018
