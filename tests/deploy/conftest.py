"""Rendered overlays, once per test session (rendering shells out to `kubectl kustomize`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_render import K8S, VARIANTS, Rendered, compose, render


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    out: dict[str, Rendered] = {}
    for variant in VARIANTS:
        overlay, *components = variant.split("+")
        if components:
            directory: Path = compose(tmp_path_factory.mktemp("compose"), overlay, components)
        else:
            directory = K8S / "overlays" / overlay
        out[variant] = Rendered(render(directory))
    return out
