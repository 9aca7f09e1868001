"""The GPU checks of cohort batching, as one prepared run on a machine with a CUDA GPU.

The checks a CPU machine cannot make (docs/cohort-batching.md, "Running the GPU
checks"), in the order of what they are worth, each in its own process with its
own time limit, so that one hang or failure costs only its own step:

1. ``env``: torch, CUDA, cuDNN, the GPU, and whether TF32 is on (``env.json``);
2. ``pytest``: the suite's GPU tests (the batched round on ``cuda`` equal to the
   per-client round for FedAvg, SCAFFOLD, FedDC, FedCDR and FedPM; the written-out
   backward bit for bit; client state on the GPU; the server's mean of
   uploads kept on the GPU bit for bit the NumPy loop's) and the rest of the
   files they live in;
3. ``equivalence``: how far a batched round is from the per-client round on
   the GPU, measured rather than asserted: the MLP (FedAvg, FedCDR, FedPM) and
   the McMahan CNN through ``vmap`` (FedAvg), with TF32 as PyTorch sets it by
   default (off for matrix products, on for cuDNN) and with TF32 off
   (``equivalence.json``);
4. ``overhead-100`` and ``overhead-10``: ``bench/overhead.py --device cuda``,
   the Synthetic MLP's table (bare loop, fast runner one client after another,
   batched) at 100 and 10 clients per round;
5. ``cnn-1000``: a round of 1,000 McMahan-CNN clients on Fashion-MNIST,
   batched, beside the bare loop, and batched without the local steps (what
   a round costs besides its arithmetic);
6. ``overhead-fmnist``: the Fashion-MNIST MLPs and the CNN at 10 per round;
7. ``profile-cnn-1000``: the batched 1,000-client round of step 5 under
   cProfile (``profiled/profiles/``: where its host time goes).

A machine with a GPU often has no internet. ``pack``, run where pip works,
puts what such a machine lacks into one folder (the kit): wheels of the
packages fedaccel and its tests import that a CUDA PyTorch image with the
usual scientific stack does not carry (Flower, flwr-datasets and their own
needs), at the versions installed here, built for the target's Python; and
the Fashion-MNIST files. ``run`` installs the kit's wheels into a private
folder (not into the target's environment), puts it and this checkout on the
path, and runs the steps, skipping those that no longer fit in ``--budget``:

    python bench/gpu_check.py pack --python 3.12          # here: .gpu-kit/ (about 50 MB)
    python3 bench/gpu_check.py run --out results/gpu       # there, from the checkout with .gpu-kit/

Everything lands in ``--out``: ``env.json``, ``steps.jsonl`` (one line per step:
status, seconds), ``log.txt`` (every step's output), ``equivalence.json`` and
``overhead/`` (``results.jsonl`` and ``table.md``, as ``bench/overhead.py`` writes
them; the rows say ``cuda``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
# What a CUDA PyTorch image with the scientific stack (numpy, scipy, pandas,
# pyarrow, matplotlib, scikit-learn, pytest, hypothesis, requests, httpx, rich,
# typer, grpcio, protobuf, huggingface-hub...) lacks of what fedaccel's fast
# runner and its GPU tests import; grpcio and protobuf are carried at the
# versions Flower was installed with here. Each at the version installed here.
KIT_DISTRIBUTIONS = (
    "flwr", "flwr-datasets", "datasets", "dill", "multiprocess", "cryptography", "cffi", "pycryptodome",
    "iterators", "grpcio", "grpcio-health-checking", "protobuf", "tomli", "tomli_w", "sniffio", "pycparser",
    "trio", "outcome",
)
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
SITE = Path("/tmp/fedaccel-gpu-site")  # where run installs the kit's wheels
# wheels for any x86-64 Linux with glibc 2.28 or newer
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


# ----------------------------------------------------------------------------- pack (here)

def pack(kit: Path, python: str, data: Path) -> int:
    """Wheels of :data:`KIT_DISTRIBUTIONS` for ``python`` and the Fashion-MNIST files into ``kit``."""
    from importlib import metadata

    wheels = kit / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    pins = []
    for name in KIT_DISTRIBUTIONS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"[gpu-check] {name} is not installed here: install fedaccel first (bash scripts/install.sh)")
            return 2
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(wheels)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    print(f"[gpu-check] downloading {len(pins)} wheels for Python {python}: {' '.join(pins)}", flush=True)
    if subprocess.run(cmd + pins).returncode != 0:
        print("[gpu-check] pip download failed (above); the kit is incomplete")
        return 1
    missing = [f for f in FASHION_FILES if not (data / f).is_file()]
    if missing:
        print(f"[gpu-check] no Fashion-MNIST in {data} ({', '.join(missing)} missing): install Debian's "
              "dataset-fashion-mnist or pass --data DIR; the kit has no Fashion-MNIST, so the CNN and "
              "Fashion-MNIST steps will be skipped there")
    else:
        target = kit / "data" / "fashion-mnist"
        target.mkdir(parents=True, exist_ok=True)
        for f in FASHION_FILES:
            shutil.copyfile(data / f, target / f)
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    print(f"[gpu-check] kit ready: {kit} ({size / 2**20:.0f} MB); on the GPU machine, from this checkout: "
          f"python3 bench/gpu_check.py run --kit {kit.name} --out OUT")
    return 0


# ----------------------------------------------------------------------------- run (there)

def install_kit(kit: Path) -> str | None:
    """Install the kit's wheels into :data:`SITE` (once); the reason when that fails."""
    wheels = sorted((kit / "wheels").glob("*.whl"))
    if not wheels:
        return f"no wheels in {kit / 'wheels'}: run `python bench/gpu_check.py pack` where pip works"
    marker = SITE / ".installed"
    wanted = "\n".join([sys.version.split()[0], *(w.name for w in wheels)])
    if not marker.exists() or marker.read_text() != wanted:  # another kit or another Python: anew
        shutil.rmtree(SITE, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                               *map(str, wheels)], capture_output=True, text=True)
        if done.returncode != 0:
            return "pip install of the kit failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
        marker.write_text(wanted)
    return None


def step_commands(out: Path, python: str, device: str = "cuda") -> list[tuple[str, list[str], int, bool]]:
    """(name, command, time limit in seconds, needs Fashion-MNIST) in the order they run."""
    bench = [python, str(ROOT / "bench" / "overhead.py"), "--device", device, "--out", str(out / "overhead")]
    synthetic = ["--workloads", "mlp-synthetic", "--algos", "fedavg", "scaffold", "feddc", "fedcdr", "fedpm",
                 "--modes", "bare", "fast", "cohort", "--rounds", "10"]
    return [
        ("env", [python, __file__, "env", "--out", str(out), "--device", device], 120, False),
        ("pytest", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(ROOT / "tests" / "test_cohort.py"), str(ROOT / "tests" / "test_client_state.py"),
                    str(ROOT / "tests" / "test_memory.py"), str(ROOT / "tests" / "test_arrays.py")], 240, False),
        ("equivalence", [python, __file__, "equivalence", "--out", str(out), "--device", device], 180, False),
        ("overhead-100", bench + synthetic + ["--per-round", "100"], 420, False),
        ("overhead-10", bench + synthetic + ["--per-round", "10"], 200, False),
        ("cnn-1000", bench + ["--workloads", "cnn-fmnist", "--algos", "fedavg", "--modes", "bare", "cohort", "no-steps",
                              "--clients", "1000", "--per-round", "1000", "--rounds", "3"], 300, True),
        ("overhead-fmnist", bench + ["--workloads", "mlp-fmnist", "mlp200-fmnist", "cnn-fmnist", "--algos",
                                     "fedavg", "--modes", "bare", "fast", "cohort", "--rounds", "5"], 300, True),
        ("profile-cnn-1000", [python, str(ROOT / "bench" / "overhead.py"), "--device", device,
                              "--out", str(out / "profiled"), "--workloads", "cnn-fmnist", "--algos", "fedavg",
                              "--modes", "cohort", "--clients", "1000", "--per-round", "1000", "--rounds", "3",
                              "--profile"], 240, True),
    ]


def run_step(cmd: list[str], env: dict[str, str], log, limit: float) -> str:
    """Run one step in a session of its own, so that at its time limit the
    step and every process it started (bench/overhead.py measures in child
    processes) are stopped, not left running beside the next step."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the step left behind (nothing, when it ended well)
        except ProcessLookupError:
            pass
        proc.wait()
    return "timed out" if code is None else "passed" if code == 0 else f"failed (exit {code})"


def run(kit: Path, out: Path, budget: float, only: list[str] | None, device: str = "cuda") -> int:
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")

    def say(line: str) -> None:
        print(f"[gpu-check] {line}", flush=True)
        log.write(f"[gpu-check] {line}\n")
        log.flush()

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if importlib.util.find_spec("flwr") is None:  # not installed here: the kit's wheels are
        problem = install_kit(kit)
        if problem:
            say(problem)
            return 2
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    else:  # installed (a development machine): the kit's wheels are not needed
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    in_kit = (kit / "data" / "fashion-mnist" / FASHION_FILES[0]).is_file()
    if in_kit:
        env["FEDACCEL_DATA_DIR"] = str(kit / "data")
    has_fmnist = in_kit or (FASHION_MNIST / FASHION_FILES[0]).is_file()
    failed = 0
    # a step starts when a minute (or its limit) is left, or 90 % of a budget
    # shorter than that; one that the budget cuts is "cut at the budget", not a failure
    for name, cmd, limit, needs_fmnist in step_commands(out, sys.executable, device):
        if only and name not in only:
            continue
        left = budget - (time.monotonic() - start)
        status, seconds = "skipped", 0.0
        if needs_fmnist and not has_fmnist:
            reason = "no Fashion-MNIST (kit without data and none in /usr/share/datasets)"
        elif left <= 0 or left < min(limit, 60, 0.9 * budget):
            reason = f"{max(left, 0):.1f} s of the budget left"
        else:
            reason = ""
            say(f"{name}: {' '.join(cmd[1:])} (at most {min(limit, left):.0f} s)")
            t0 = time.monotonic()
            status = run_step(cmd, env, log, min(limit, left))
            if status == "timed out" and left < limit:
                status = "cut at the budget"  # not a failure: the budget ran out
            seconds = time.monotonic() - t0
            failed += status not in ("passed", "cut at the budget")
        say(f"{name}: {status}{' (' + reason + ')' if reason else ''} in {seconds:.0f} s")
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": name, "status": status, "reason": reason, "seconds": round(seconds, 1)}) + "\n")
    say(f"done in {time.monotonic() - start:.0f} s: results in {out}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- the steps of our own

def env_step(out: Path, device: str) -> int:
    """What every run records (:func:`fedaccel.torch_utils.environment`) and the CUDA side of it."""
    import torch

    from fedaccel.torch_utils import environment

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        **environment(torch.device(device if cuda else "cpu")), "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": cuda,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    (out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0 if cuda or not device.startswith("cuda") else 1


def round_difference(algo: str, model_name: str, device: str, tf32: bool, changes: dict[str, Any]) -> dict[str, Any]:
    """One round of 7 ragged clients, batched and one client after another, on
    ``device``: the largest absolute and relative difference of their replies.
    ``tf32``: TF32 as PyTorch sets it by default (off for matrix products, on
    for cuDNN's convolutions), else off for both; restored after. The row
    records the flags it ran with."""
    import torch

    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if not tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        row = _round_difference(algo, model_name, device, tf32, changes)
        row.update(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
        return row
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _round_difference(algo: str, model_name: str, device: str, tf32: bool, changes: dict[str, Any]) -> dict[str, Any]:
    import copy

    import torch
    from flwr.app import RecordDict

    from fedaccel.clients.base import TrainData
    from fedaccel.clients.cohort import CohortJob, fit_cohort
    from fedaccel.clients.state import ContextState
    from fedaccel.contract import train_config_record
    from fedaccel.local_run import default_run_config, fuse
    from fedaccel.models import build_model
    from fedaccel.registry import get_algorithm
    from fedaccel.run_config import parse_run_config
    from fedaccel.torch_utils import seeded_generator, state_to_arrays

    shape = (1, 28, 28) if model_name == "cnn" else (60,)
    cfg = parse_run_config(fuse(default_run_config(), {"algo": algo, "batch-size": 16, "device": device,
                                                       "momentum": 0.9, **changes}))
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10).to(device)
    gen = torch.Generator().manual_seed(0)
    sizes = [37, 5, 16, 90, 17, 1, 33]
    datas = [TrainData(x=torch.randn(n, *shape, generator=gen).to(device),
                       y=torch.randint(0, 10, (n,), generator=gen).to(device)) for n in sizes]

    def solver():
        s = get_algorithm(algo).solver(cfg)
        s.initial_model = copy.deepcopy(model.state_dict())
        return s

    config = train_config_record(1, 0.05, 2, None)
    config["accepted-round"] = 0
    received = {}
    if algo in ("scaffold", "feddc"):  # the server's control variate c, not zero, so that the correction counts
        from fedaccel.clients.scaffold import C_RECORD, control_variate_record
        received = {C_RECORD: control_variate_record({k: 0.1 * torch.randn(p.shape, generator=gen).numpy()
                                                      for k, p in model.named_parameters()})}
    per_client = [solver().fit(copy.deepcopy(model), d, config, ContextState(RecordDict()),
                               seeded_generator(0, 1, c, "train"), received) for c, d in enumerate(datas)]
    jobs = [CohortJob(solver=solver(), data=d, arrays=state_to_arrays(model), config=config,
                      state=ContextState(RecordDict()), generator=seeded_generator(0, 1, c, "train"),
                      received=received)
            for c, d in enumerate(datas)]
    batched = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    worst_abs = worst_rel = 0.0
    for a, b in zip(per_client, batched):
        if isinstance(b, BaseException):
            raise b
        # the weights, and the extra records (SCAFFOLD's dc) in the same order
        pairs = list(zip(a.arrays.values(), b.arrays.values()))
        for key in a.extra:
            pairs += zip(a.extra[key].values(), b.extra[key].values())
        for x, y in pairs:
            p, q = torch.from_numpy(x.numpy()).double(), torch.from_numpy(y.numpy()).double()
            diff = (p - q).abs().max().item()
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(p.abs().max().item(), 1e-12))
    return {"algo": algo, "model": model_name, "changes": changes, "device": device, "tf32": tf32, "clients": len(sizes),
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel}


def equivalence_step(out: Path, device: str) -> int:
    rows = []
    for algo, model_name, changes in [("fedavg", "mlp", {"weight-decay": 1e-3}),
                                      ("scaffold", "mlp", {}),
                                      ("scaffold", "mlp", {"scaffold.cv-update": "option-ii"}),
                                      ("feddc", "mlp", {"feddc.alpha": 0.5}),
                                      ("fedcdr", "mlp", {"fedcdr.eta": 0.5}),
                                      ("fedpm", "mlp", {}),
                                      ("fedavg", "cnn", {})]:
        for tf32 in (True, False):
            row = round_difference(algo, model_name, device, tf32, changes)
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "equivalence.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="here, where pip works: the kit of wheels and data")
    pk.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor; default 3.12)")
    pk.add_argument("--kit", type=Path, default=KIT)
    pk.add_argument("--data", type=Path, default=FASHION_MNIST, help="the Fashion-MNIST folder to copy")
    rn = sub.add_parser("run", help="on the GPU machine: every step, results in --out")
    rn.add_argument("--kit", type=Path, default=KIT)
    rn.add_argument("--out", type=Path, default=ROOT / "results" / "gpu-check")
    rn.add_argument("--budget", type=float, default=480.0, help="seconds for all steps (default 480)")
    rn.add_argument("--only", nargs="+", help="these steps only (env pytest equivalence overhead-100 ...)")
    rn.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the kit here")
    for name in ("env", "equivalence"):  # the steps of our own, each run in its own process by run
        sp = sub.add_parser(name, help=argparse.SUPPRESS)
        sp.add_argument("--out", type=Path, required=True)
        sp.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.command == "pack":
        return pack(args.kit.resolve(), args.python, args.data)
    if args.command == "run":
        names = [name for name, *_ in step_commands(args.out, sys.executable)]
        unknown = sorted(set(args.only or []) - set(names))
        if unknown:
            p.error(f"--only {' '.join(unknown)}: unknown step; the steps are {', '.join(names)}")
        return run(args.kit.resolve(), args.out.resolve(), args.budget, args.only, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "env":
        return env_step(args.out, args.device)
    return equivalence_step(args.out, args.device)


if __name__ == "__main__":
    sys.exit(main())
