"""The registry is lazy: names without imports, one algorithm's code per client.

A ClientApp must import only its own algorithm's strategy module and solver
(fedaccel/registry.py): these tests run a client's setup in a fresh
interpreter and list which algorithm modules it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedaccel.config import ConfigError
from fedaccel.registry import algorithm_names, all_algorithms, get_algorithm

ROOT = Path(__file__).resolve().parents[1]


def _fresh_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


LOADED = """
import json, sys
from fedaccel.registry import algorithm_names
names = algorithm_names()
{body}
loaded = sorted(m.rsplit('.', 1)[1] for m in sys.modules
                if m.startswith('fedaccel.strategies.') and m.rsplit('.', 1)[1] in names)
print(json.dumps({{"names": list(names), "loaded": loaded}}))
"""


@pytest.mark.slow  # a fresh interpreter importing torch: 4 s, run by the full suite
@pytest.mark.parametrize("algo", ["fedcdr", "fedpm"])
def test_a_client_imports_only_its_own_algorithm(algo: str) -> None:
    """Listing the names imports no algorithm; a client's setup then imports its own only."""
    body = f"""
before = sorted(m.rsplit('.', 1)[1] for m in sys.modules
                if m.startswith('fedaccel.strategies.') and m.rsplit('.', 1)[1] in names)
assert before == [], before
import fedaccel.apps.client_app as ca
from fedaccel.local_run import default_run_config
cfg = default_run_config(); cfg["algo"] = {algo!r}
solver = ca._shared(ca._freeze(cfg), 4, "").solver
assert type(solver).__module__.startswith("fedaccel.clients."), type(solver)
"""
    out = _fresh_python(LOADED.format(body=body))
    assert out["loaded"] == [algo]
    assert set(out["names"]) >= {"fedavg", "fedcdr", "fednova", "fedpm", "fedrkmgc", "fedacg", "gcfed"}


def test_each_module_is_named_after_its_algorithm() -> None:
    specs = all_algorithms()
    assert list(specs) == list(algorithm_names())
    for name, spec in specs.items():
        assert spec.name == name
        assert type(spec).__module__ == "fedaccel.algorithm"


def test_an_unknown_algorithm_names_the_allowed_ones_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        get_algorithm("fedcrd")
    text = str(err.value)
    assert "algo" in text and "fedcdr" in text and "did you mean" in text.lower()
