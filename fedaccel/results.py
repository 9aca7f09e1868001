"""Recording, summarising and plotting the results of one federated run.

A run writes four files into ``results/<run-name>/``:

``config.json``
    The full resolved run configuration (sorted keys, indent 2), written as
    soon as the :class:`RunRecorder` is created.
``metrics.jsonl``
    One JSON object per line, one line per round, written and flushed as the
    round ends (so a crashed run still leaves its curve behind).  Every line
    has the keys ``round, accg, loss, accl, bytes_up, bytes_down, seconds``
    (missing ones are written as ``null``) followed by any extra keys the
    caller passed (``train_loss`` ...).  NaN / inf are written as ``null``.
``summary.json``
    The dict returned by :func:`summarize`, written by :meth:`RunRecorder.finish`.
``curves.png``
    Accuracy vs round and accuracy vs cumulative MB, see :func:`plot_curves`.
``status.json``
    Where the run stands, for whoever watches it (``fedaccel-dashboard``):
    ``state`` (``running``, ``finished``, ``failed``, ``stopped``), ``round``
    of ``num_rounds``, the writing process's ``pid`` and ``host``, ``engine``
    and Flower's ``run_id``, ``started``/``updated`` (Unix time) and the
    one-line ``error`` of a failed run. Replaced atomically as each round ends.
    A run whose process died without a word (SIGKILL, power loss) stays
    ``running`` here; a reader on the same host tells it by the dead ``pid``.

Accuracies are always *fractions* in ``[0, 1]``; a value such as ``87.5``
(a percentage by mistake) is rejected with :class:`ValueError`.

Matplotlib is imported lazily and only through :class:`matplotlib.figure.Figure`
with the Agg canvas, so recording never needs a display and never changes the
global pyplot backend.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from fedaccel.processes import pid_alive, process_record

__all__ = [
    "STANDARD_KEYS",
    "RunRecorder",
    "summarize",
    "plot_curves",
    "load_run",
    "load_status",
    "cumulative_mb",
]

#: Keys present on every line of ``metrics.jsonl``, in this order.
STANDARD_KEYS: tuple[str, ...] = (
    "round",
    "accg",
    "loss",
    "accl",
    "bytes_up",
    "bytes_down",
    "seconds",
)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"
STATUS_FILE = "status.json"

#: the values of ``status.json``'s ``state``
RUN_STATES = ("running", "finished", "failed", "stopped")

_EMA_FACTOR = 0.9
_LAST_N = 20


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _jsonable(value: Any) -> Any:
    """Return *value* converted to plain JSON types.

    numpy scalars/arrays become Python numbers/lists, NaN and +-inf become
    ``None``, tuples/sets become lists, Paths and other unknown objects become
    their ``str``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays / 0-d arrays
        return _jsonable(value.tolist())
    if hasattr(value, "item"):  # other numpy scalar types
        try:
            return _jsonable(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


def _dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (no NaN literals) of ``_jsonable(obj)``."""
    return json.dumps(_jsonable(obj), allow_nan=False, **kwargs)


def _check_accuracy(name: str, value: Any, where: str = "") -> float | None:
    """Validate one accuracy value and return it as ``float`` (or ``None``).

    ``None`` and NaN mean "not measured" and give ``None``.  Anything else
    must be a real number in ``[0, 1]``; otherwise :class:`ValueError`
    (with a hint when it looks like a percentage).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}{where} must be a number in [0, 1] or None, got {value!r}")
    f = float(value)
    if math.isnan(f):
        return None
    if not 0.0 <= f <= 1.0:
        hint = " (looks like a percentage; pass a fraction, e.g. 0.875 not 87.5)" if 1.0 < f <= 100.0 else ""
        raise ValueError(f"{name}{where} must be a fraction in [0, 1], got {value!r}{hint}")
    return f


def _num(value: Any) -> float | None:
    """``float(value)`` for finite real numbers, else ``None``."""
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _round_bytes(row: dict) -> float:
    """``bytes_up + bytes_down`` of one row, treating missing/None as 0."""
    return (_num(row.get("bytes_up")) or 0.0) + (_num(row.get("bytes_down")) or 0.0)


def cumulative_mb(rows: Iterable[dict]) -> list[float]:
    """Cumulative traffic after each row, in MB (``(bytes_up + bytes_down) / 1e6``)."""
    out: list[float] = []
    total = 0.0
    for row in rows:
        total += _round_bytes(row)
        out.append(total / 1e6)
    return out


def _fmt_mb(nbytes: Any) -> str:
    return f"{(_num(nbytes) or 0.0) / 1e6:.2f} MB"


# --------------------------------------------------------------------------- #
# summary
# --------------------------------------------------------------------------- #
def summarize(rows: list[dict], target_accuracy: float | None) -> dict:
    """Summarise the per-round rows of one run.

    Rows whose ``accg`` is ``None`` (or missing / NaN) are skipped for the
    accuracy statistics but still count towards ``num_rounds``, ``total_mb``
    and ``total_seconds``.

    Returns a dict with keys

    * ``final_accg``: last non-None ``accg``;
    * ``best_accg``: max ``accg``;
    * ``mean_last_20_accg``: mean of the last 20 non-None ``accg`` values
      (of all of them if there are fewer);
    * ``ema_accg``: exponential moving average over the non-None ``accg``
      sequence, ``ema = 0.9 * ema + 0.1 * acc``, initialised to the first value;
    * ``rounds_to_target``: the ``round`` of the first row whose
      ``accg >= target_accuracy``; ``None`` if never reached or no target;
    * ``num_rounds``: number of rows;
    * ``total_mb``: sum of ``bytes_up + bytes_down`` over rows / 1e6;
    * ``total_seconds``: sum of ``seconds`` over rows;
    * ``final_accl``: last non-None ``accl`` or ``None``;
    * ``target_accuracy``: as given.

    With no ``accg`` values at all, every accuracy-derived key is ``None``
    (no exception); the counting keys are still filled in.
    """
    accs: list[float] = []
    rounds_to_target = None
    final_accl = None
    total_bytes = 0.0
    total_seconds = 0.0
    for row in rows:
        acc = _num(row.get("accg"))
        if acc is not None:
            accs.append(acc)
            if (
                rounds_to_target is None
                and target_accuracy is not None
                and acc >= target_accuracy
            ):
                rounds_to_target = row.get("round")
        accl = _num(row.get("accl"))
        if accl is not None:
            final_accl = accl
        total_bytes += _round_bytes(row)
        total_seconds += _num(row.get("seconds")) or 0.0

    if accs:
        ema = accs[0]
        for acc in accs[1:]:
            ema = _EMA_FACTOR * ema + (1.0 - _EMA_FACTOR) * acc
        last = accs[-_LAST_N:]
        final, best, mean_last, ema_accg = accs[-1], max(accs), sum(last) / len(last), ema
    else:
        final = best = mean_last = ema_accg = None

    return {
        "final_accg": final,
        "best_accg": best,
        "mean_last_20_accg": mean_last,
        "ema_accg": ema_accg,
        "rounds_to_target": rounds_to_target,
        "num_rounds": len(rows),
        "total_mb": total_bytes / 1e6,
        "total_seconds": total_seconds,
        "final_accl": final_accl,
        "target_accuracy": target_accuracy,
    }


# --------------------------------------------------------------------------- #
# plotting
# --------------------------------------------------------------------------- #
def _new_figure(ncols: int = 2, width: float = 11.0, height: float = 4.2):
    """A pyplot-free Figure on the Agg canvas (no display, nothing to close).

    Fixed margins, not ``layout="constrained"``: every run draws its curves
    when it ends, and the constrained layout (which measures every label
    first) made that 0.33 s against 0.19 s (an 11 x 4.2 inch figure of two
    panels, 2-core CPU; drawing the curves was 30 % of the quick test
    tier's time, by a py-spy sample). The margins leave room for the axis
    labels beside the widest tick labels an accuracy curve gets (eight
    characters, "0.899950" for a curve that moves by a few millionths;
    matplotlib puts narrower ranges in an offset)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.09, right=0.985, bottom=0.12, top=0.85, wspace=0.26)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _style_axes(ax_round, ax_mb) -> None:
    ax_round.set_xlabel("round")
    ax_round.set_ylabel("test accuracy")
    ax_round.set_title("accuracy vs rounds")
    ax_mb.set_xlabel("cumulative communication (MB)")
    ax_mb.set_ylabel("test accuracy")
    ax_mb.set_title("accuracy vs communication")
    for ax in (ax_round, ax_mb):
        ax.grid(True, alpha=0.3)


def plot_curves(rows: list[dict], path: Path, title: str = "") -> None:
    """Write one PNG with two panels for a single run.

    Left: ``accg`` vs round.  Right: ``accg`` vs cumulative MB
    (``(bytes_up + bytes_down) / 1e6`` summed up to and including that round).
    Rounds where the mean client local accuracy ``accl`` was evaluated are
    drawn as points on both panels.  Works (with an empty plot) when there is
    nothing to draw.  Creates the parent directory if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    curves_figure(rows, title).savefig(path, dpi=110)


def curves_figure(rows: list[dict], title: str = ""):
    """The figure :func:`plot_curves` writes (a matplotlib ``Figure``)."""
    fig, (ax_round, ax_mb) = _new_figure()
    mbs = cumulative_mb(rows)

    g = [(r.get("round"), mb, _num(r.get("accg"))) for r, mb in zip(rows, mbs)]
    g = [(rd, mb, a) for rd, mb, a in g if a is not None]
    l = [(r.get("round"), mb, _num(r.get("accl"))) for r, mb in zip(rows, mbs)]
    l = [(rd, mb, a) for rd, mb, a in l if a is not None]

    if g:
        ax_round.plot([x[0] for x in g], [x[2] for x in g], "-", color="C0", label="accg (server test)")
        ax_mb.plot([x[1] for x in g], [x[2] for x in g], "-", color="C0", label="accg (server test)")
    if l:
        ax_round.plot([x[0] for x in l], [x[2] for x in l], "o", ms=4, color="C1", label="accl (client local)")
        ax_mb.plot([x[1] for x in l], [x[2] for x in l], "o", ms=4, color="C1", label="accl (client local)")
    if not g and not l:
        for ax in (ax_round, ax_mb):
            ax.text(0.5, 0.5, "no accuracy recorded", ha="center", va="center", transform=ax.transAxes)
    _style_axes(ax_round, ax_mb)
    if g or l:
        ax_round.legend(loc="lower right", fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def progress_line(row: dict, num_rounds: int) -> str:
    """The one-line progress message of a (normalised) row, as runs print it."""
    width = len(str(num_rounds))
    parts = [f"[fedaccel] round {row['round']:>{width}}/{num_rounds}"]
    if row.get("accg") is not None:
        parts.append(f"accg {row['accg']:.4f}")
    if row.get("loss") is not None:
        parts.append(f"loss {row['loss']:.4f}")
    if row.get("accl") is not None:
        parts.append(f"accl {row['accl']:.4f}")
    if row.get("bytes_up") is not None:
        parts.append(f"up {_fmt_mb(row['bytes_up'])}")
    if row.get("bytes_down") is not None:
        parts.append(f"down {_fmt_mb(row['bytes_down'])}")
    if row.get("seconds") is not None:
        parts.append(f"{row['seconds']:.2f} s")
    for key in ("gap", "dist"):  # optimality=true: to the optimum (fedaccel.optimum)
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.3e}")
    return "  ".join(parts)


# --------------------------------------------------------------------------- #
# recorder
# --------------------------------------------------------------------------- #
class RunRecorder:
    """Writes ``results/<run-name>/`` for one run.

    Usage::

        rec = RunRecorder(run_dir, config, target_accuracy=0.8, num_rounds=100)
        for r in range(1, 101):
            ...
            rec.log_round({"round": r, "accg": 0.81, "loss": 0.53, "accl": None,
                           "bytes_up": 1_230_000, "bytes_down": 1_250_000, "seconds": 0.21})
        summary = rec.finish()

    It can also be used as a context manager; leaving the ``with`` block
    without calling :meth:`finish` just closes ``metrics.jsonl`` (the rows
    written so far stay on disk).

    Parameters
    ----------
    run_dir:
        Output directory (created with parents).
    config:
        The full resolved configuration; written at once to ``config.json``.
    target_accuracy:
        Fraction in ``[0, 1]`` (or ``None``) used for ``rounds_to_target``.
    num_rounds:
        Planned number of rounds; only used in the progress line.
    quiet:
        If true, :meth:`log_round` prints nothing (:meth:`finish` still prints
        where the results are).
    rows:
        Rows already recorded (a run resumed from a checkpoint): written
        first, replacing whatever ``metrics.jsonl`` held.
    engine, run_id:
        What runs it (``fast`` runner or ``flower``) and the engine's run id
        (``flwr stop RUN_ID`` stops a Flower run), written to ``status.json``.
    tracker:
        Where the same rows go too (:mod:`fedaccel.trackers`: TensorBoard,
        MLflow), told each round and the end state; one that fails is
        dropped with one line, the run and its files go on.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: dict,
        target_accuracy: float | None,
        num_rounds: int,
        quiet: bool = False,
        rows: list[dict] | None = None,
        engine: str = "fast",
        run_id: int | None = None,
        tracker: Any = None,
    ) -> None:
        self.target_accuracy = _check_accuracy("target_accuracy", target_accuracy)
        self.run_dir = Path(run_dir)
        self.config = dict(config)
        self.num_rounds = int(num_rounds)
        self.quiet = quiet
        self.rows: list[dict] = []
        self.summary: dict | None = None
        self.tracker = tracker

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(
            _dumps(self.config, sort_keys=True, indent=2) + "\n", encoding="utf-8"
        )
        self._metrics = open(self.run_dir / METRICS_FILE, "w", encoding="utf-8")
        for row in rows or ():  # a resumed run: the rounds before its checkpoint, as they were
            self._metrics.write(_dumps(row) + "\n")
            self.rows.append(row)
        self._metrics.flush()
        self._status = {"state": "running", "round": len(self.rows), "num_rounds": self.num_rounds,
                        **process_record(), "engine": engine,
                        "run_id": run_id, "started": time.time(), "updated": time.time(), "error": None}
        self._write_status()

    def _write_status(self, **changes: Any) -> None:
        """Replace ``status.json`` atomically (a reader never sees half of it)."""
        self._status.update(changes, updated=time.time())
        tmp = self.run_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(_dumps(self._status, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / STATUS_FILE)

    def fail(self, error: str, state: str = "failed") -> None:
        """Record that the run ended early (``failed`` with its one-line
        ``error``, or ``stopped`` by the user) and close ``metrics.jsonl``."""
        if state not in RUN_STATES[2:]:
            raise ValueError(f"state must be one of {RUN_STATES[2:]}, got {state!r}")
        self.close()
        if self._status["state"] == "running":
            self._write_status(state=state, error=error or None)
            self._track("close", state)

    def _track(self, method: str, arg: Any) -> None:
        """Call the tracker; one that raises prints one line and is dropped."""
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(arg)
        except Exception as err:  # a tracking server gone must not end the run
            print(f"[fedaccel] warning: tracker {self.tracker.name} failed after round {len(self.rows)} "
                  f"({type(err).__name__}: {err}); it gets no more metrics, the run and {METRICS_FILE} go on",
                  flush=True)
            self.tracker = None

    # -- context manager ---------------------------------------------------
    def __enter__(self) -> "RunRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close ``metrics.jsonl`` (idempotent)."""
        if not self._metrics.closed:
            self._metrics.close()

    # -- per round ---------------------------------------------------------
    def _normalise(self, row: dict) -> dict:
        if not isinstance(row, dict):
            raise TypeError(f"row must be a dict, got {type(row).__name__}")
        if "round" not in row:
            raise ValueError(f"row has no 'round' key: {row!r}")
        rnd = row["round"]
        if isinstance(rnd, bool) or not isinstance(rnd, numbers.Integral):
            raise ValueError(f"'round' must be an int, got {rnd!r}")
        where = f" (round {int(rnd)})"
        out: dict[str, Any] = {"round": int(rnd)}
        for key in ("accg", "accl"):
            out[key] = _check_accuracy(key, row.get(key), where)
        for key in ("loss", "bytes_up", "bytes_down", "seconds"):
            val = row.get(key)
            if val is not None and (isinstance(val, bool) or not isinstance(val, numbers.Real)):
                raise ValueError(f"{key}{where} must be a number or None, got {val!r}")
            if key.startswith("bytes") and val is not None and val < 0:
                raise ValueError(f"{key}{where} must be >= 0, got {val!r}")
            out[key] = val
        for key, val in row.items():
            if key not in out:
                out[key] = val
        return _jsonable(out)

    def progress_line(self, row: dict) -> str:
        """The one-line progress message for a (normalised) row."""
        return progress_line(row, self.num_rounds)

    def log_round(self, row: dict) -> None:
        """Validate, append one line to ``metrics.jsonl`` (flushed) and print progress.

        ``row`` needs at least ``round`` (int); ``accg``, ``loss``, ``accl``,
        ``bytes_up``, ``bytes_down``, ``seconds`` default to ``None`` when
        absent.  Accuracies must be fractions in ``[0, 1]`` or ``None``
        (NaN counts as ``None``); otherwise :class:`ValueError` and nothing is
        written.  The standard keys come first in the written line, then any
        extra keys unchanged (numpy values converted, NaN/inf -> null).
        """
        if self._metrics.closed:
            raise RuntimeError(f"RunRecorder for {self.run_dir} is closed")
        clean = self._normalise(row)
        self._metrics.write(_dumps(clean) + "\n")
        self._metrics.flush()
        self.rows.append(clean)
        self._write_status(round=clean["round"])
        self._track("log_round", clean)
        if not self.quiet:
            print(self.progress_line(clean), flush=True)

    # -- end ---------------------------------------------------------------
    def finish(self, extra_files: tuple[str, ...] = ()) -> dict:
        """Write ``summary.json`` and ``curves.png``; return the summary dict.

        Closes ``metrics.jsonl``.  Prints
        ``[fedaccel] results written to <absolute run_dir> (<files>)``, quiet or
        not; ``extra_files`` are files the caller wrote there too.
        """
        self.close()
        summary = summarize(self.rows, self.target_accuracy)
        (self.run_dir / SUMMARY_FILE).write_text(
            _dumps(summary, indent=2) + "\n", encoding="utf-8"
        )
        name = self.config.get("algo") or self.run_dir.name
        plot_curves(self.rows, self.run_dir / CURVES_FILE, title=f"{name} ({self.run_dir.name})")
        self.summary = summary
        self._write_status(state="finished")
        self._track("close", "finished")
        # printed even when quiet: the lines that say where everything went
        if self.tracker is not None:
            print(f"[fedaccel] metrics also in {self.tracker.where}", flush=True)
        files = ", ".join((METRICS_FILE, SUMMARY_FILE, CURVES_FILE, CONFIG_FILE) + tuple(extra_files))
        print(f"[fedaccel] results written to {self.run_dir.resolve()} ({files})", flush=True)
        return summary


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #
def _read_json_object(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {what} {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"malformed {what} {path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def load_rows(path: str | Path) -> list[dict]:
    """Read ``metrics.jsonl``; blank lines are ignored.

    Raises :class:`FileNotFoundError` if missing and :class:`ValueError`
    naming the file and line if a line is not a JSON object with ``round``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed metrics file {path}, line {lineno}: {e}") from None
            if not isinstance(row, dict) or "round" not in row:
                raise ValueError(
                    f"malformed metrics file {path}, line {lineno}: expected an object with a 'round' key"
                )
            rows.append(row)
    return rows


def load_status(run_dir: str | Path) -> dict | None:
    """``status.json`` of a run, or None when it has none (a run recorded
    before it existed) or it cannot be read."""
    try:
        status = json.loads((Path(run_dir) / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


_UNREAD: dict = {}  # run_finished's default: read status.json itself


def run_finished(run_dir: str | Path, status: dict | None = _UNREAD) -> bool:
    """Whether a run folder holds a finished run: a readable ``summary.json``
    and, when it has a ``status.json``, that status ``finished`` (written
    last: a run killed after its summary and before its status, or started
    again in an old folder, is not finished). Runs recorded before
    ``status.json`` existed count by their summary. ``status``: what
    :func:`load_status` gave for this folder, when the caller read it
    already (None: it has none)."""
    try:
        if not isinstance(json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8")), dict):
            return False
    except (OSError, ValueError):
        return False
    if status is _UNREAD:
        status = load_status(run_dir)
    return status is None or status.get("state") == "finished"


#: written into a run folder when the dashboard asks its run to stop
#: (``confirmed``: Flower stopped it, ``flwr stop``)
STOP_FILE = "stop-requested.json"


def _stop_confirmed(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / STOP_FILE).read_text(encoding="utf-8")).get("confirmed") is True
    except (OSError, ValueError, AttributeError):
        return False


def recorded_state(run_dir: str | Path, status: dict) -> tuple[str, str | None]:
    """The state of a run that has a ``status.json`` (``status``) and the
    one-line reason of one that ended early: the status's own, except
    ``stopped`` for a run stopped from the dashboard (Flower confirmed the
    stop, or its process is gone and a stop was asked) and ``interrupted``
    for a run whose process is gone without a word (:func:`writer_gone`).
    The dashboard's runs list and fedaccel-compare show the same."""
    run_dir = Path(run_dir)
    state = str(status.get("state", "unknown"))
    if state == "running" and _stop_confirmed(run_dir):
        return "stopped", "stopped from the dashboard (flwr stop; Flower lists it as finished)"
    if writer_gone(status):
        if (run_dir / STOP_FILE).is_file():
            return "stopped", "stopped from the dashboard"
        return "interrupted", "its process ended without recording why (killed?)"
    return state, status.get("error")


def writer_gone(status: dict) -> bool:
    """Whether a run whose ``status.json`` says ``running`` lost the process
    that writes it: recorded on this host, and that process is no longer
    alive (a run killed without a word; one on another host cannot be told)."""
    return (status.get("state") == "running" and status.get("host") == socket.gethostname()
            and isinstance(status.get("pid"), int) and not pid_alive(status["pid"], status.get("pid_start")))


def load_run(run_dir: str | Path, require_summary: bool = True) -> tuple[dict, list[dict], dict]:
    """Load ``(config, rows, summary)`` from a run directory.

    Raises :class:`FileNotFoundError` (naming the path) if the directory,
    ``config.json`` or ``metrics.jsonl`` is missing, and :class:`ValueError`
    (naming the path) if one of them is malformed.  ``summary.json`` is
    required too unless ``require_summary=False``, in which case a missing
    summary is recomputed from the rows (useful for runs that crashed before
    :meth:`RunRecorder.finish`), taking the target from
    ``config["target-accuracy"]`` / ``config["target_accuracy"]`` if present.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    config = _read_json_object(run_dir / CONFIG_FILE, "config file")
    rows = load_rows(run_dir / METRICS_FILE)
    summary_path = run_dir / SUMMARY_FILE
    if summary_path.exists() or require_summary:
        summary = _read_json_object(summary_path, "summary file")
    else:
        target = config.get("target-accuracy", config.get("target_accuracy"))
        summary = summarize(rows, _num(target))
    return config, rows, summary


if __name__ == "__main__":  # pragma: no cover - tiny manual check
    for d in sys.argv[1:]:
        print(json.dumps(load_run(d)[2], indent=2))
