"""fedaccel-federations: the documented way to change a simulation's size keeps
the profile's resources (flwr run --federation-config drops them)."""

from __future__ import annotations

import tomli
import pytest

from fedaccel.federations import main


@pytest.fixture
def flwr_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert main(["install"]) == 0
    return tmp_path


def profile(home, name):
    return tomli.loads((home / "config.toml").read_text())["superlink"][name]


def test_size_changes_only_num_supernodes(flwr_home, capsys):
    before = profile(flwr_home, "local-simulation-gpu")
    assert main(["size", "local-simulation-gpu", "300"]) == 0
    after = profile(flwr_home, "local-simulation-gpu")
    assert after["options"]["num-supernodes"] == 300
    assert after["options"]["backend"] == before["options"]["backend"]  # 2 CPUs, 0.25 GPU kept
    assert after["options"]["backend"]["client-resources"] == {"num-cpus": 2, "num-gpus": 0.25}
    assert profile(flwr_home, "local-simulation")["options"]["num-supernodes"] == 20  # others untouched
    assert "num-supernodes = 300" in capsys.readouterr().out


@pytest.mark.parametrize("args,wanted", [
    (["size", "nope", "10"], "profile 'nope' is not installed (installed: "),
    (["size", "deployment", "10"], "profile 'deployment' is a real federation"),
    (["size", "local-simulation", "0"], "must be >= 1"),
])
def test_size_refuses_with_one_line(flwr_home, capsys, args, wanted):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wanted in err[0]
