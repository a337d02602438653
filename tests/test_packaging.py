"""pyproject's explicit ``packages`` list names every package under the mapped folders.

Editable installs import any folder with an ``__init__.py``, so a package missing from the list works in
development and in CI and is absent only from a regular install (the Docker image, a wheel).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_folder_is_listed_for_regular_installs() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = _packages_on_disk(setuptools["package-dir"])
    listed = set(setuptools["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - on_disk == set(), "listed but not a package folder"
