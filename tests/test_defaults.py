"""Every algorithm's defaults are written once: the params dataclass and
pyproject.toml's ``[tool.flwr.app.config.<prefix>]`` table must agree.

``flwr run`` reads pyproject.toml, code that builds a params object directly
(tests, tools) gets the dataclass defaults; a value changed in one place only
would make the two disagree silently. Compared generically over whatever the
registry discovers, field by field (``server_momentum`` <-> key
``<prefix>.server-momentum``), in both directions: a field without a key and a
key without a field both fail.
"""

from __future__ import annotations

import dataclasses

import pytest

from fedaccel.local_run import default_run_config
from fedaccel.registry import all_algorithms

SPECS = list(all_algorithms().values())


def key_of(prefix: str, field: dataclasses.Field) -> str:
    return f"{prefix}.{field.name.replace('_', '-')}"


@pytest.fixture(scope="module")
def pyproject():
    return default_run_config()


def same(a, b) -> bool:
    """Equal values of compatible TOML types (an int key for a float field is
    fine, as the config parser converts it; a bool is never a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_params_defaults_equal_pyproject(spec, pyproject):
    fields = dataclasses.fields(spec.params)
    wrong = []
    for f in fields:
        key = key_of(spec.prefix, f)
        if f.default is dataclasses.MISSING:
            wrong.append(f"{spec.params.__name__}.{f.name} has no default")
        elif key not in pyproject:
            wrong.append(f"{key} is missing from pyproject.toml (dataclass default {f.default!r})")
        elif not same(f.default, pyproject[key]):
            wrong.append(f"{key}: pyproject.toml has {pyproject[key]!r}, "
                         f"{spec.params.__name__}.{f.name} defaults to {f.default!r}")
    known = {key_of(spec.prefix, f) for f in fields}
    stale = sorted(k for k in pyproject if k.startswith(f"{spec.prefix}.") and k not in known)
    wrong += [f"{k} is in pyproject.toml but {spec.params.__name__} has no such field" for k in stale]
    assert not wrong, "\n".join(wrong)


def test_every_algorithm_is_checked():
    """The comparison above runs over the registry, so a new algorithm is
    covered without editing this file; at least the algorithms the audit of
    the defaults covered must be there."""
    names = {spec.name for spec in SPECS}
    assert {"fedprox", "feddyn", "scaffold", "fedrkmgc", "fedacg"} <= names


def test_gc_defaults_match_pyproject(pyproject):
    """``gc.*`` keys fall back to :class:`GCConfig`'s defaults when absent
    (parse_run_config); pyproject's ``[tool.flwr.app.config.gc]`` must say the
    same. ``mode`` is the exception by design: the key's ``auto`` resolves to
    the algorithm's ``default_gc_mode``, whose fallback is GCConfig's ``none``."""
    from fedaccel.config import GCConfig

    default = GCConfig()
    keys = {"lam": "gc.lambda", "global_layers": "gc.global-layers", "vectors": "gc.vectors",
            "weight_decay": "gc.weight-decay", "global_scope": "gc.global-scope"}
    assert {f.name for f in dataclasses.fields(GCConfig)} - set(keys) == {"mode"}
    for name, key in keys.items():
        assert pyproject[key] == getattr(default, name), key
    assert pyproject["gc.mode"] == "auto" and default.mode == "none"
    assert {k for k in pyproject if k.startswith("gc.")} == set(keys.values()) | {"gc.mode"}


def test_synthetic_defaults_match_pyproject(pyproject):
    """``synthetic.*`` keys fall back to :class:`SyntheticConfig`'s defaults
    (which are data.DataConfig's): all three say the same."""
    from fedaccel.data import DataConfig
    from fedaccel.config import SyntheticConfig

    default = SyntheticConfig()
    for f in dataclasses.fields(SyntheticConfig):
        key = f"synthetic.{f.name.replace('_', '-')}"
        assert pyproject[key] == getattr(default, f.name) == getattr(DataConfig, f"synthetic_{f.name}"), key
