"""Rules about the production code that a reviewer should not have to remember."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedaccel",)


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


def _lint_imports(config: Path) -> str:
    import shutil
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.is_file() or shutil.which("lint-imports"), "pip install -e '.[dev]' (import-linter)"
    proc = subprocess.run([str(exe) if exe.is_file() else "lint-imports", "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_every_module_has_a_layer():
    """A new module of fedaccel/ must be placed in a layer, or the linter
    would not check it."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {name.strip() for c in config["contracts"] if c["type"] == "layers"
               for layer in c["layers"] for name in layer.replace("|", ":").split(":")}
    modules = {f"fedaccel.{p.stem}" for p in (ROOT / "fedaccel").glob("*.py") if p.stem != "__init__"}
    assert modules and sorted(modules - layered) == []


def test_import_contracts_hold(tmp_path):
    """One lint-imports run checks every import contract:

    - pyproject's [tool.importlinter] layers (entry points > runtime >
      run-config reading > registry > algorithms > shared machinery > config
      schema > core), with no ignored imports;
    - no algorithm's strategy module imports another's, and no solver module
      another solver module (shared machinery: fedaccel/strategies/base.py,
      server_steps, douglas_rachford, fedaccel/clients/base.py, state, ...). These
      module lists come from the registry, so a new algorithm is checked
      without editing any list."""
    from fedaccel.registry import all_algorithms

    specs = all_algorithms()
    strategy_modules = sorted(f"fedaccel.strategies.{name}" for name in specs)
    solver_modules = sorted({spec.solver.__module__ for spec in specs.values()} - {"fedaccel.clients.base"})
    assert len(strategy_modules) >= 14 and len(solver_modules) >= 8
    listing = lambda mods: "[" + ", ".join(f'"{m}"' for m in mods) + "]"  # noqa: E731
    pyproject = (ROOT / "pyproject.toml").read_text()
    layers = pyproject[pyproject.index("[tool.importlinter]"):]  # the file's last section
    config = tmp_path / "contracts.toml"
    config.write_text(f"""{layers}
[[tool.importlinter.contracts]]
name = "algorithms' strategy modules are independent"
type = "independence"
modules = {listing(strategy_modules)}

[[tool.importlinter.contracts]]
name = "algorithms' solver modules are independent"
type = "independence"
modules = {listing(solver_modules)}
""")
    assert "3 kept, 0 broken" in _lint_imports(config)
