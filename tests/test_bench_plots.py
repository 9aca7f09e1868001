"""The bench scripts draw their figures through bench/plots.py: each script's plot
function writes a non-empty PNG from tiny fake run records, with the panel titles,
axis labels and series labels it had before (no training runs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fakes import bench_script

# about 5 s (torch import and one matplotlib render per figure): the full suite runs it
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch):
    # the scripts import their siblings (runner, plots) as `python bench/<script>.py` does
    monkeypatch.syspath_prepend(str(BENCH))


def _script(name: str):
    return bench_script(name)


@pytest.fixture
def figures(monkeypatch):
    """The Figures that bench/plots.plot_panels returns, in call order."""
    import plots

    drawn, real = [], plots.plot_panels
    monkeypatch.setattr(plots, "plot_panels", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    return drawn


def _png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rec(seed: int = 0, rounds: int = 4, **kw) -> dict:
    curve = [(r, 0.4 + 0.1 * r + 0.01 * seed) for r in range(1, rounds + 1)]
    return {"seed": seed, "accg_curve": curve, "num-server-rounds": rounds, **kw}


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.axison]


def _labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []


def test_plot_panels_grid_bands_blank_cells_and_labels(tmp_path):
    import plots

    x = np.arange(5.0)
    panels = [("a", [("one", x, x, x * 0.1), ("empty", [], []), ("two", x, 2 * x)]),
              ("b", [("three", list(x), list(x))]),
              ("c", [])]
    path = tmp_path / "sub" / "grid.png"
    fig = plots.plot_panels(panels, path, ncols=2, xlabel=("round", "MB"), linestyles=plots.LINESTYLES)
    _png(path)
    axes = fig.axes
    assert len(axes) == 4 and not axes[3].axison  # 3 panels in a 2 x 2 grid: the 4th is blank
    assert _titles(fig) == ["a", "b", "c"]
    assert [ax.get_xlabel() for ax in axes[:3]] == ["round", "round", "MB"]
    assert _labels(axes[0]) == ["one", "two"] and axes[2].get_legend() is None
    # the empty series keeps its slot: "two" is series 2, so colour C2 and style ':'
    assert [line.get_color() for line in axes[0].lines] == ["C0", "C2"]
    assert [line.get_linestyle() for line in axes[0].lines] == ["-", ":"]
    assert len(axes[0].collections) == 1  # one band, for the series that has a std


def test_mean_series():
    import plots

    assert plots.mean_series("m", []) == ("m", [], [])
    label, x, mean, std = plots.mean_series("m", [_rec(0)])
    assert label == "m (n=1)" and std is None and list(x) == [1, 2, 3, 4]
    label, x, mean, std = plots.mean_series("m", [_rec(0), _rec(2)], failed=1)
    assert label == "m (n=2, 1 failed)" and np.allclose(mean, [51, 61, 71, 81]) and np.allclose(std, 1)


def test_fedacg_gcfed(tmp_path, figures):
    mod = _script("fedacg_gcfed")
    main = [_rec(s, method=m, lr=0.05) for m in ("FedAvg", "GC-Fed", "FedACG (full)") for s in (0, 1)]
    mom = [_rec(0, method="FedAvg", lr=0.01, phase="momentum")]
    mod.plot_curves(main, mom, tmp_path / "curves.png")
    _png(tmp_path / "curves.png")
    (fig,) = figures
    assert _titles(fig) == [*mod.GROUPS, "Local momentum 0 vs 0.9"]
    assert {ax.get_ylabel() for ax in fig.axes} == {"test accuracy (%)"}
    assert _labels(fig.axes[1]) == ["FedAvg (n=2)", "GC-Fed (n=2)"]
    assert _labels(fig.axes[2]) == ["FedAvg, mom 0 (n=1)", "FedAvg, mom 0.9 lr 0.01 (n=1)",
                                    "FedACG (full), mom 0 (n=1)"]
    assert fig.axes[0].get_ylim()[0] == 30


def test_fedcdr_table1(tmp_path, figures):
    mod = _script("fedcdr_table1")
    recs = [_rec(s, method=m, dataset=d) for m in mod.METHODS for d in mod.DATASETS for s in (0, 1)]
    mod.plot_curves(recs, tmp_path / "table1_curves.png", panels=list(mod.DATASETS), panel_key="dataset",
                    panel_title=lambda d: f"Synthetic-{d}", series=list(mod.METHODS))
    _png(tmp_path / "table1_curves.png")
    (fig,) = figures
    assert _titles(fig) == [f"Synthetic-{d}" for d in mod.DATASETS]
    assert _labels(fig.axes[0]) == [f"{m} (n=2)" for m in mod.METHODS]
    assert {ax.get_xlabel() for ax in fig.axes} == {"round"}


def test_fedpm_test1(tmp_path, figures):
    mod = _script("fedpm_test1")
    gap = [1.0, 1e-3, 1e-9, 0.0]
    kept = {"FedAvg": ("lr", 0.5, [1.0, 0.1, 0.01, 0.001], gap),
            "SCAFFOLD": ("server-lr", 1.0, [1.0, 0.5, float("nan"), float("nan")], gap)}
    mod.plot(kept, tmp_path / "test1.png", "Test 1: fake")
    _png(tmp_path / "test1.png")
    (fig,) = figures
    assert _titles(fig) == [r"$|F(w_r) - F(w^*)|$ (floored at 1e-16)", r"$\|w_r - w^*\|$"]
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_legend() is None
    assert _labels(fig.axes[1]) == ["FedAvg (lr 0.5)", "SCAFFOLD (server lr 1)"]
    assert fig.get_suptitle() == "Test 1: fake"


def test_fedpm_test2(tmp_path, figures):
    mod = _script("fedpm_test2")
    ok = [_rec(s, total_mb=40.0) for s in (0, 1)]
    failed = {**_rec(2), "accg_curve": [], "error": "boom"}
    panels = [("Dirichlet 0.3", [("FedAvg", [*ok, failed]), ("FedPM", [_rec(0)])]),
              ("Dirichlet 0.1", [("FedAvg", ok)])]
    mod.plot(panels, tmp_path / "curves.png")
    _png(tmp_path / "curves.png")
    (fig,) = figures
    assert _titles(fig) == ["Dirichlet 0.3", "Dirichlet 0.1"] * 2
    assert [ax.get_xlabel() for ax in fig.axes] == ["round"] * 2 + ["cumulative traffic, up + down (MB)"] * 2
    assert _labels(fig.axes[0]) == ["FedAvg (n=2, 1 failed)", "FedPM (n=1)"]
    assert _labels(fig.axes[2]) == ["FedAvg (n=2, 1 failed)"]  # FedPM has no traffic recorded
    assert list(fig.axes[2].lines[0].get_xdata()) == [10.0, 20.0, 30.0, 40.0]  # 10 MB a round


def test_gradient_correction(tmp_path, figures):
    mod = _script("gradient_correction")
    good = [_rec(s) for s in (0, 1)]
    panels = [(f"Dirichlet 0.3: {t}", [("FedAvg", [*good, {**_rec(3), "error": "x"}]), ("SCAFFOLD", good)])
              for t in ("baselines", "FedRKMGC ablation (Tables 3/9)", "more")]
    mod.plot(panels, tmp_path / "curves.png")
    _png(tmp_path / "curves.png")
    (fig,) = figures
    assert len(fig.axes) == 4 and not fig.axes[3].axison
    assert _titles(fig) == [t for t, _ in panels]
    assert _labels(fig.axes[0]) == ["FedAvg (n=2)", "SCAFFOLD (n=2)"]


def test_no_script_sets_up_matplotlib_itself():
    for name in ("fedacg_gcfed", "fedcdr_table1", "fedpm_test1", "fedpm_test2", "gradient_correction"):
        assert "matplotlib" not in (BENCH / f"{name}.py").read_text(), name
