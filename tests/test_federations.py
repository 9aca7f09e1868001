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


@pytest.mark.parametrize("profile,cpus,gpus", [("local-simulation", 1, 0.0), ("local-simulation-gpu", 2, 0.25)])
def test_simulation_overrides_keep_the_profiles_resources_per_client(profile, cpus, gpus):
    """``--federation-config`` replaces a profile's options whole, so the text
    that sizes a simulation carries the profile's backend and resources per
    client too (``num-supernodes=N`` alone gave each client Flower's default
    2 CPUs: one Ray worker on a 2-core machine); read as Flower reads it."""
    from flwr.common.config import parse_config_args
    from flwr.supercore.utils import simulation_config_from_json

    from fedaccel.federations import simulation_overrides

    text = simulation_overrides(profile, 7)
    parsed = simulation_config_from_json({k.replace("-", "_"): v for k, v in parse_config_args([text]).items()})
    assert (parsed.num_supernodes, parsed.backend) == (7, "ray")
    assert (parsed.client_resources_num_cpus, parsed.client_resources_num_gpus) == (cpus, gpus)
    with pytest.raises(ValueError, match="no profile 'nope'"):
        simulation_overrides("nope", 7)
