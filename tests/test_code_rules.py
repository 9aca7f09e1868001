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
