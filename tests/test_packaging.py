"""What a non-editable install gets: pyproject.toml names its packages by hand (kernels/ and web/
install as minisgl.kernels and minisgl.web), so a package added under minisgl/ must be added there.

minisgl.constrained (structured output) was missing from the list: every test passed against the
editable checkout, and `pip install .` gave an Engine that could not import its scheduler.
"""

from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_under_minisgl_is_installed() -> None:
    on_disk = {
        os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
        for dirpath, _, files in os.walk(os.path.join(ROOT, "minisgl"))
        if "__init__.py" in files
    }
    listed = set(_setuptools_config()["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_the_mapped_top_level_folders_are_installed_too() -> None:
    config = _setuptools_config()
    for package, folder in config["package-dir"].items():
        assert package in config["packages"] and os.path.isdir(os.path.join(ROOT, folder)), package
