"""pyproject.toml in the forms current setuptools reads without a deprecation warning."""

from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_and_the_build_needs_a_setuptools_that_reads_it():
    config = tomllib.loads(PYPROJECT.read_text())
    assert config["project"]["license"] == "Apache-2.0"  # a TOML table is deprecated since setuptools 77
    assert config["build-system"]["requires"] == ["setuptools>=77"]
