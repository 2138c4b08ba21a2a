"""Packaging: one source of the version, the license, the package data, README links that work
on a package index page (absolute, to files that exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import te_paged
from te_paged import _version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
REPO_URL = "https://github.com/te-paged/te_paged"


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once(project) -> None:
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "te_paged._version.__version__"
    assert te_paged.__version__ is _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)


def test_license_and_package_data(project) -> None:
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert not [c for c in project["project"]["classifiers"] if c.startswith("License ::")]
    data = project["tool"]["setuptools"]["package-data"]
    for package, files in data.items():
        for name in files:
            assert (ROOT / package.replace(".", "/") / name).is_file(), (package, name)
    assert "py.typed" in data["te_paged"]


def test_readme_links_are_absolute_and_point_at_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert links, "README.md has no links"
    for link in links:
        assert link.startswith("https://"), f"relative link {link}: broken on a package page"
        if link.startswith(f"{REPO_URL}/blob/main/"):
            path = link.removeprefix(f"{REPO_URL}/blob/main/").split("#")[0]
            assert (ROOT / path).is_file(), link
