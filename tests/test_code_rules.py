"""Rules about the production code that a reviewer should not have to remember."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apps", "clients", "strategies", "models", "data", "fedaccel")


def production_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_bare_assert_in_production_code():
    """``assert`` vanishes under ``python -O`` and a bare AssertionError tells a
    user nothing: production code raises an error that says what went wrong."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for path in production_files()
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Assert)]
    assert production_files() and found == []


def test_layers_import_only_downward():
    """pyproject's [tool.importlinter] layers hold (entry points > runtime >
    run-config reading > registry > algorithms > shared machinery > config
    schema > core); the known knots are listed there as ignored imports."""
    import shutil
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.is_file() or shutil.which("lint-imports"), "pip install -e '.[dev]' (import-linter)"
    proc = subprocess.run([str(exe) if exe.is_file() else "lint-imports", "--config", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout
