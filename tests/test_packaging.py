"""The installed project cannot collide with a user's own packages.

Everything fedaccel ships lives under the one package ``fedaccel``
(``fedaccel.strategies``, ``fedaccel.clients``, ``fedaccel.models``,
``fedaccel.data``, ``fedaccel.apps``), and the editable install exposes only
that package (hatch's ``dev-mode-exact``), so a user's ``data`` or ``models``
package, or a ``tests`` folder, is never shadowed by ours or merged with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ("apps", "clients", "strategies", "models", "data", "bench", "tests", "scripts", "configs", "docs")


@pytest.mark.slow  # a fresh interpreter per name: 3.5 s
def test_only_fedaccel_is_importable_from_outside_the_project(tmp_path: Path) -> None:
    """From another folder, the generic names resolve to a user's own packages
    (none here), and ``fedaccel`` to this checkout."""
    user_pkg = tmp_path / "models"
    user_pkg.mkdir()
    (user_pkg / "__init__.py").write_text("OWNER = 'user'\n")
    code = f"""
import importlib.util, json
import fedaccel.strategies.fedcdr, fedaccel.apps.client_app
import models
print(json.dumps({{"found": {{n: bool(importlib.util.find_spec(n)) for n in {GENERIC!r} if n != "models"}},
                  "models": models.OWNER, "fedaccel": fedaccel.__path__[0]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["found"] == {n: False for n in GENERIC if n != "models"}
    assert seen["models"] == "user"
    assert Path(seen["fedaccel"]).resolve() == ROOT / "fedaccel"


def test_the_wheel_and_the_flower_components_name_only_fedaccel() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["fedaccel"]
    components = project["tool"]["flwr"]["app"]["components"]
    assert set(components.values()) == {"fedaccel.apps.server_app:app", "fedaccel.apps.client_app:app"}
    assert not [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "fedaccel"]
