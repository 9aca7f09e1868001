"""Compare several fedaccel runs: one plot and one Markdown table.

Command line::

    fedaccel-compare RUN_DIR [RUN_DIR ...] [--out DIR] [--target ACC]
                     [--label-key KEY] [--group-seeds] [--include-unfinished]

(also ``python -m fedaccel.compare ...``).  Writes into ``--out`` (default
``results/compare``):

``comparison.png``
    accg vs rounds and accg vs cumulative MB, one line per run (or, with
    ``--group-seeds``, the mean over seeds with a +-1 std band per group).
``comparison.md``
    A Markdown table with columns run, algo, final, best, mean of last 20,
    rounds to target, total MB.  Accuracies are percentages with 2 decimals,
    "-" where a value is missing.

All statistics are recomputed from each run's ``metrics.jsonl`` with
:func:`fedaccel.results.summarize`.  The target is each run's own
``target_accuracy`` (from ``summary.json``, else the run config's
``target-accuracy``) unless ``--target`` overrides it for all runs.

Only finished runs are compared: a run is finished when it wrote
``summary.json`` and its ``status.json`` (if it has one) says ``finished``.
A failed, stopped, interrupted or still running run is left out, with one
line saying which run, its state and the round it reached.  With
``--include-unfinished`` such runs are listed, marked in the run column and
the plot legend (``run-x [failed, round 5 of 60]``) and their "final" cell
(``59.55 (unfinished)``); they never enter a group over seeds.

``--group-seeds`` groups runs whose configs are identical apart from
``seed``, ``run-name`` and ``results-dir`` and reports, per group, the mean
+- sample standard deviation (ddof=1; 0 for a single seed) of final / best /
mean-of-last-20 accuracy and total MB, and the mean rounds to target over the
seeds that reached it together with how many did ("k/n").  Each seed counts
once: where several runs of a group share a seed (the same run from the fast
runner and from ``flwr run``, say), the first one given is kept and the
others are set aside, one line each naming them; they still appear in the
per-run table.

Errors (missing directory, missing/malformed files, a run with no metrics)
print one line ``fedaccel-compare: error: ...`` on stderr and give exit code 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fedaccel.results import (
    _check_accuracy,
    _new_figure,
    _num,
    _style_axes,
    cumulative_mb,
    load_run,
    load_status,
    recorded_state,
    run_finished,
    summarize,
)

__all__ = ["main", "compare_runs", "load_runs", "run_state_of", "group_by_seed", "grouping_notes",
           "unfinished_note", "assign_run_labels", "runs_table", "groups_table", "target_note", "RunInfo",
           "SEED_KEYS"]

#: Config keys ignored when deciding whether runs differ only by seed.
SEED_KEYS = frozenset({"seed", "run-name", "results-dir", "run_name", "results_dir",
                       # how a run was checkpointed and resumed does not change its numbers
                       "checkpoint-every", "checkpoint_every", "resume",
                       # nor where its metrics were sent too
                       "tracker", "tracker_uri", "tracker-uri"})

PNG_NAME = "comparison.png"
MD_NAME = "comparison.md"
PROG = "fedaccel-compare"


@dataclass
class RunInfo:
    """One loaded run, with its summary recomputed for the chosen target."""

    path: Path
    config: dict
    rows: list[dict]
    summary: dict
    label: str = ""
    #: ``finished``, or how the run stands: ``failed``, ``stopped``,
    #: ``running``, ``interrupted``, ``unfinished`` (no summary, no status)
    state: str = "finished"
    #: planned rounds, when the run says (status.json or num-server-rounds)
    num_rounds: int | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    @property
    def progress(self) -> str:
        """``"failed, round 5 of 60"``: the state and the last round recorded."""
        done = self.rows[-1].get("round") if self.rows else 0
        of = f" of {self.num_rounds}" if self.num_rounds else ""
        return f"{self.state}, round {done}{of}"

    @property
    def marked_name(self) -> str:
        """The run's name, with ``[failed, round 5 of 60]`` when unfinished."""
        return self.name if self.finished else f"{self.name} [{self.progress}]"

    @property
    def algo(self) -> str:
        return str(self.config.get("algo", "?"))


@dataclass
class Group:
    """Runs that differ only by seed."""

    runs: list[RunInfo]
    label: str = ""
    seeds: list[Any] = field(default_factory=list)
    #: runs set aside because an earlier run of the group has their seed:
    #: (the run set aside, the run kept)
    duplicates: list[tuple[RunInfo, RunInfo]] = field(default_factory=list)


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #
def _run_target(config: dict, summary: dict) -> float | None:
    if "target_accuracy" in summary:
        return _num(summary.get("target_accuracy"))
    return _num(config.get("target-accuracy", config.get("target_accuracy")))


def run_state_of(path: Path, config: dict) -> tuple[str, int | None]:
    """``(state, planned rounds)`` of a run folder.  ``finished`` needs
    ``summary.json`` and, when there is a ``status.json``, its ``finished``
    (a run started again in an old folder keeps the old summary while it
    runs); otherwise the state the dashboard shows (``failed``, ``stopped``,
    ``running``, ``interrupted`` for a dead writer on this host), or
    ``unfinished`` where nothing says more."""
    status = load_status(path)
    total = _num((status or {}).get("num_rounds")) or _num(config.get("num-server-rounds"))
    total = int(total) if total else None
    if run_finished(path, status):  # the status read above, not read again
        return "finished", total
    if status is None:
        return "unfinished", total
    state = recorded_state(path, status)[0]  # as the dashboard's runs list shows it
    return (state if state not in ("finished", "unknown") else "unfinished"), total


def load_runs(run_dirs: Sequence[str | Path], target: float | None = None) -> list[RunInfo]:
    """Load every run and recompute its summary.

    ``target`` (a fraction) overrides each run's own target accuracy.  Each
    run's :attr:`RunInfo.state` says whether it finished (see
    :func:`run_state_of`); unfinished runs are loaded too, it is up to the
    caller to leave them out or mark them (:func:`compare_runs` does).
    Raises ``FileNotFoundError`` / ``ValueError`` naming the offending path,
    also for a run whose ``metrics.jsonl`` has no rows.
    """
    if not run_dirs:
        raise ValueError("no run directories given")
    runs = []
    for d in run_dirs:
        path = Path(d)
        config, rows, summary = load_run(path, require_summary=False)
        if not rows:
            raise ValueError(f"no metrics in {path / 'metrics.jsonl'} (run has no rounds)")
        tgt = target if target is not None else _run_target(config, summary)
        state, total = run_state_of(path, config)
        runs.append(RunInfo(path=path, config=config, rows=rows, summary=summarize(rows, tgt),
                            state=state, num_rounds=total))
    return runs


def _label_base(config: dict, label_key: str | None) -> str:
    if label_key:
        return str(config.get(label_key, "?"))
    return str(config.get("algo", "?"))


def assign_run_labels(runs: list[RunInfo], label_key: str | None) -> None:
    """Label = algo (or config[label_key]); add the run dir name where labels repeat."""
    bases = [_label_base(r.config, label_key) for r in runs]
    for r, base in zip(runs, bases):
        r.label = f"{base} ({r.name})" if bases.count(base) > 1 else base
        if not r.finished:
            r.label += f" [{r.progress}]"


# What the seed draws, recorded in a run's resolved config: the partition
# sizes and the test-set size (Synthetic's clients and a Dirichlet split
# change with the seed). Not settings: runs differing in them still group.
SEED_DRAWN = frozenset({"partition-sizes", "global-test-size",
                        "torch-threads", "environment"})  # the machine's, not settings: recorded for reproducing
# What the dataset and model settings imply, recorded to rebuild the model
# (fedaccel.runtime.load_final_model); runs recorded before these keys
# still group with newer ones of the same settings.
IMPLIED = frozenset({"input-shape", "num-classes"})


def _group_key(config: dict) -> str:
    settings = {k: v for k, v in config.items() if k not in SEED_KEYS}
    if isinstance(settings.get("resolved"), dict):
        settings["resolved"] = {k: v for k, v in settings["resolved"].items()
                                if k not in SEED_KEYS | SEED_DRAWN | IMPLIED}
    return json.dumps(settings, sort_keys=True, default=str)


def group_by_seed(runs: list[RunInfo], label_key: str | None = None) -> list[Group]:
    """Group finished runs whose configs are equal except for :data:`SEED_KEYS`.

    Unfinished runs (:attr:`RunInfo.finished` false) join no group.  Each
    seed counts once: a run whose group already has a run with its seed is
    set aside in :attr:`Group.duplicates` (:func:`grouping_notes` says so),
    so the same seed run twice (fast runner and ``flwr run``) neither adds to
    n nor fakes a spread of 0.  Groups keep the order of their first run.
    Label = algo (or ``config[label_key]``); where several groups would share
    a label, the config keys that differ between them are appended
    (``"fedavg (lr=0.1)"``).
    """
    groups: dict[str, Group] = {}
    for r in runs:
        if not r.finished:
            continue
        g = groups.setdefault(_group_key(r.config), Group(runs=[]))
        seed = r.config.get("seed")
        # (a run that recorded no seed is no duplicate of another: nothing says they are one run)
        kept = None if seed is None else next((k for k, s in zip(g.runs, g.seeds) if _same_seed(s, seed)), None)
        if kept is not None:
            g.duplicates.append((r, kept))
            continue
        g.runs.append(r)
        g.seeds.append(seed)
    out = list(groups.values())
    bases = [_label_base(g.runs[0].config, label_key) for g in out]
    for g, base in zip(out, bases):
        same = [h for h, b in zip(out, bases) if b == base]
        if len(same) == 1:
            g.label = base
            continue
        cfgs = [h.runs[0].config for h in same]
        keys = sorted({k for c in cfgs for k in c} - SEED_KEYS - {"resolved"})  # resolved repeats the keys
        differing = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in cfgs}) > 1]
        cfg = g.runs[0].config
        extra = ", ".join(f"{k}={cfg.get(k)}" for k in differing) or g.runs[0].name
        g.label = f"{base} ({extra})"
    return out


def _same_seed(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def unfinished_note(run: RunInfo) -> str:
    """The line that says an unfinished run was left out, and why."""
    return (f"left out {run.path}: {run.progress}, not finished "
            f"(--include-unfinished lists it, marked)")


def grouping_notes(runs: list[RunInfo], groups: list[Group]) -> list[str]:
    """One line per run that is in no group's statistics: a duplicate seed
    (which run was kept) or an unfinished run."""
    notes = [f"seed {_seed_str(kept)} counted once in group {g.label}: set aside {dup.path} "
             f"(same seed and settings as {kept.path})"
             for g in groups for dup, kept in g.duplicates]
    notes += [f"not in any group: {r.path} ({r.progress})" for r in runs if not r.finished]
    return notes


def _seed_str(run: RunInfo) -> str:
    return str(run.config.get("seed", "(none recorded)"))


# --------------------------------------------------------------------------- #
# formatting
# --------------------------------------------------------------------------- #
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.2f}"


def _pct_pm(values: list[float]) -> str:
    if not values:
        return "-"
    m, s = _mean_std(values)
    return f"{100.0 * m:.2f} ± {100.0 * s:.2f}"


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for a single value)."""
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return m, s


def _md_table(header: list[str], rows: list[list[str]], align_right_from: int = 2) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" if i < align_right_from else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def runs_table(runs: list[RunInfo]) -> tuple[list[str], list[list[str]]]:
    """The per-run table (header, rows of strings): fedaccel-compare's
    Markdown and the dashboard's compare page show exactly these cells."""
    header = ["run", "algo", "final (%)", "best (%)", "mean of last 20 (%)", "rounds to target", "total MB"]
    body = []
    for r in runs:
        s = r.summary
        rtt = s["rounds_to_target"]
        final = _pct(s["final_accg"])
        body.append([
            r.marked_name,
            r.algo,
            final if r.finished else f"{final} (unfinished)",
            _pct(s["best_accg"]),
            _pct(s["mean_last_20_accg"]),
            "-" if rtt is None else str(rtt),
            f"{s['total_mb']:.2f}",
        ])
    return header, body


def groups_table(groups: list[Group]) -> tuple[list[str], list[list[str]]]:
    """The per-group table (mean ± std over seeds), as :func:`runs_table`."""
    header = [
        "group", "algo", "seeds", "final (%)", "best (%)", "mean of last 20 (%)",
        "rounds to target (reached)", "total MB",
    ]
    body = []
    for g in groups:
        sums = [r.summary for r in g.runs]
        col = lambda k: [s[k] for s in sums if s[k] is not None]  # noqa: E731
        reached = col("rounds_to_target")
        n = len(sums)
        rtt = f"{statistics.fmean(reached):.1f} ({len(reached)}/{n})" if reached else f"- (0/{n})"
        mb_m, mb_s = _mean_std(col("total_mb"))
        body.append([
            g.label,
            g.runs[0].algo,
            str(n),
            _pct_pm(col("final_accg")),
            _pct_pm(col("best_accg")),
            _pct_pm(col("mean_last_20_accg")),
            rtt,
            f"{mb_m:.2f} ± {mb_s:.2f}",
        ])
    return header, body


def target_note(runs: list[RunInfo], override: float | None) -> str:
    if override is not None:
        return f"Target accuracy: {100 * override:.2f}% (set with --target)."
    targets = {r.name: r.summary["target_accuracy"] for r in runs}
    distinct = set(targets.values())
    if distinct == {None}:
        return "Target accuracy: none set (rounds to target is '-')."
    if len(distinct) == 1:
        return f"Target accuracy: {100 * next(iter(distinct)):.2f}% (from the runs)."
    parts = ", ".join(f"{n}: {'-' if t is None else f'{100 * t:.2f}%'}" for n, t in targets.items())
    return f"Target accuracy per run: {parts}."


# --------------------------------------------------------------------------- #
# plotting
# --------------------------------------------------------------------------- #
def _accg_points(rows: list[dict]) -> tuple[list, list, list]:
    xs, mbs, ys = [], [], []
    for row, mb in zip(rows, cumulative_mb(rows)):
        a = _num(row.get("accg"))
        if a is not None:
            xs.append(row.get("round"))
            mbs.append(mb)
            ys.append(a)
    return xs, mbs, ys


def _plot_runs(runs: list[RunInfo], path: Path) -> None:
    fig, (ax_r, ax_mb) = _new_figure()
    for i, r in enumerate(runs):
        xs, mbs, ys = _accg_points(r.rows)
        ax_r.plot(xs, ys, "-", color=f"C{i % 10}", label=r.label)
        ax_mb.plot(mbs, ys, "-", color=f"C{i % 10}", label=r.label)
    _style_axes(ax_r, ax_mb)
    ax_r.legend(loc="lower right", fontsize="small")
    fig.suptitle("fedaccel comparison")
    fig.savefig(path, dpi=110)


def _plot_groups(groups: list[Group], path: Path) -> None:
    """Mean accg (+-1 std band) over seeds at the rounds all seeds recorded."""
    import numpy as np

    fig, (ax_r, ax_mb) = _new_figure()
    for i, g in enumerate(groups):
        per_run = []
        for r in g.runs:
            xs, mbs, ys = _accg_points(r.rows)
            per_run.append({x: (mb, y) for x, mb, y in zip(xs, mbs, ys)})
        common = sorted(set.intersection(*(set(d) for d in per_run)))
        if not common:
            continue
        acc = np.array([[d[x][1] for x in common] for d in per_run])
        mb = np.array([[d[x][0] for x in common] for d in per_run]).mean(axis=0)
        mean = acc.mean(axis=0)
        std = acc.std(axis=0, ddof=1) if len(per_run) > 1 else np.zeros_like(mean)
        color = f"C{i % 10}"
        label = f"{g.label} (n={len(g.runs)})"
        for ax, x in ((ax_r, np.array(common, dtype=float)), (ax_mb, mb)):
            ax.plot(x, mean, "-", color=color, label=label)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    _style_axes(ax_r, ax_mb)
    ax_r.legend(loc="lower right", fontsize="small")
    fig.suptitle("fedaccel comparison (mean ± std over seeds)")
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- #
# API
# --------------------------------------------------------------------------- #
def _is_compare_output(path: Path, out: Path) -> bool:
    """True for *out* itself or an earlier comparison folder (not a run)."""
    if path.resolve() == out.resolve():
        return True
    return (path / MD_NAME).is_file() and not (path / "config.json").exists()


def compare_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    target: float | None = None,
    label_key: str | None = None,
    group_seeds: bool = False,
    include_unfinished: bool = False,
) -> str:
    """Write ``comparison.png`` and ``comparison.md`` into *out_dir*; return the Markdown.

    ``target`` is a fraction in [0, 1] overriding every run's own target
    (rounds to target is then recomputed from the rows).  ``label_key``
    picks the config key used for legend labels instead of ``algo``.
    With ``group_seeds=True`` a per-group table (mean ± std over seeds) comes
    first, followed by the per-run table, and the plot shows group means.

    Unfinished runs (failed, stopped, interrupted, running: see
    :func:`run_state_of`) are left out, one line each in the Markdown's
    notes, unless ``include_unfinished``: then they are listed, marked, and
    still join no group.  Runs of a group that repeat a seed are set aside,
    one line each (:func:`group_by_seed`).  ``ValueError`` when no finished
    run is left and ``include_unfinished`` is false.

    Folders that are comparison outputs (*out_dir* itself, or any folder with
    ``comparison.md`` and no ``config.json``) are skipped, so
    ``fedaccel-compare results/*`` works after a first comparison.
    Raises ``FileNotFoundError`` / ``ValueError`` (with the path) on bad input.
    """
    target = _check_accuracy("--target", target)
    out = Path(out_dir)
    run_dirs = [d for d in run_dirs if not _is_compare_output(Path(d), out)]
    runs = load_runs(run_dirs, target)
    notes: list[str] = []
    if not include_unfinished:
        unfinished = [r for r in runs if not r.finished]
        runs = [r for r in runs if r.finished]
        if not runs:
            raise ValueError("no finished run to compare: " + "; ".join(f"{r.path} ({r.progress})" for r in
                             unfinished) + " (--include-unfinished lists them, marked)")
        notes += [unfinished_note(r) for r in unfinished]
    assign_run_labels(runs, label_key)
    out.mkdir(parents=True, exist_ok=True)

    parts = ["# fedaccel comparison", ""]
    if group_seeds:
        groups = group_by_seed(runs, label_key)
        notes += grouping_notes(runs, groups)
        parts += ["## Grouped over seeds (mean ± std)", "", _md_table(*groups_table(groups)), "", "## Runs", ""]
        _plot_groups(groups, out / PNG_NAME)
    else:
        _plot_runs(runs, out / PNG_NAME)
    parts += [_md_table(*runs_table(runs)), "", target_note(runs, target), ""]
    if any(not r.finished for r in runs):
        parts += ["Runs marked [state, round reached of planned] did not finish: their numbers are "
                  "at the last round they recorded, not final.", ""]
    parts += [f"Note: {n}." for n in notes] + ([""] if notes else [])
    parts += [f"![comparison]({PNG_NAME})", ""]
    md = "\n".join(parts)
    (out / MD_NAME).write_text(md, encoding="utf-8")
    return md


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compare fedaccel runs: writes comparison.png and comparison.md.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="results/<run-name> directories")
    p.add_argument("--out", default="results/compare", metavar="DIR",
                   help="output directory (default: results/compare)")
    p.add_argument("--target", type=float, default=None, metavar="ACC",
                   help="target accuracy as a fraction in [0, 1] for every run "
                        "(default: each run's own target_accuracy)")
    p.add_argument("--label-key", default=None, metavar="KEY",
                   help="config key used for legend labels (default: algo)")
    p.add_argument("--group-seeds", action="store_true",
                   help="group runs that differ only in seed and report mean ± std over seeds "
                        "(each seed counted once; runs repeating a seed are set aside and named)")
    p.add_argument("--include-unfinished", action="store_true",
                   help="also list failed, stopped, interrupted and running runs, marked with their "
                        "state and the round they reached (default: left out, one line each)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fedaccel-compare``; returns the exit code (0 ok, 2 error)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage / help
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        md = compare_runs(args.run_dirs, args.out, target=args.target,
                          label_key=args.label_key, group_seeds=args.group_seeds,
                          include_unfinished=args.include_unfinished)
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(md)
    out = Path(args.out).resolve()
    print(f"[fedaccel] wrote {out / MD_NAME} and {out / PNG_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
