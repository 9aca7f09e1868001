"""``fedaccel-run``: the fast local runner.

Runs the project's ServerApp and ClientApp objects in one process on a
:class:`~fedaccel.local_grid.LocalGrid` (no Ray, no SuperLink), with exactly
the run-config keys of ``flwr run``::

    fedaccel-run algo='fedprox' num-server-rounds=20 fedprox.mu=0.1
    fedaccel-run --run-config "algo='fedadam' lr=0.1" --num-clients 50
    fedaccel-run --config experiment.yaml seed=3

Values use ``flwr run --run-config`` syntax (TOML); a bare word such as
``algo=fedavg`` is also accepted as a string. Unknown keys are rejected.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import tomli
import yaml
from flwr.common.config import flatten_dict, get_project_config

from fedaccel.config import ConfigError, RunConfig, did_you_mean, number_in_text

DEFAULT_NUM_CLIENTS = 20  # the local-simulation profile's num-supernodes (flower.toml)


def project_dir() -> Path:
    """The folder holding this project's pyproject.toml."""
    return Path(__file__).resolve().parents[1]


def default_run_config(app_dir: Path | None = None) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the project, flattened to dotted keys."""
    app_dir = app_dir or project_dir()
    config = get_project_config(app_dir)
    return flatten_dict(config["tool"]["flwr"]["app"]["config"])


def toml_value(value: Any) -> str:
    """A value as ``--run-config`` takes it (strings quoted, TOML)."""
    import tomli_w

    return tomli_w.dumps({"v": value}).partition("=")[2].strip()


def run_config_tokens(overrides: dict[str, Any]) -> list[str]:
    """``key=value`` tokens, one per override, for ``fedaccel-run`` or
    ``flwr run --run-config`` (the dashboard's launches, a sweep's Flower cells)."""
    return [f"{key}={toml_value(value)}" for key, value in overrides.items()]


def _parse_value(text: str) -> Any:
    try:
        return tomli.loads(f"v = {text}")["v"]
    except tomli.TOMLDecodeError:
        return text  # bare word -> string, for convenience


# The key=value pairs of a --run-config string: flwr's own pattern
# (flwr.common.config.parse_config_args), which silently skips what it does
# not match; parse_run_config_string refuses the leftovers instead.
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_run_config_string(text: str) -> dict[str, Any]:
    """``--run-config`` as ``flwr run`` reads it (TOML values, strings quoted),
    but a token that is not ``key=value`` or a value that is not TOML is an error."""
    if text.strip().endswith(".toml"):
        path = Path(text.strip()).expanduser()
        try:
            loaded = tomli.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise ConfigError(f"--run-config {path}: cannot read it ({err.strerror or err})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--run-config {path}: not a UTF-8 text file") from None
        except tomli.TOMLDecodeError as err:
            raise ConfigError(f"--run-config {path}: not valid TOML ({err})") from None
        return flat_config(loaded, f"--run-config {path}")
    out: dict[str, Any] = {}
    leftover = _PAIR.sub(" ", text).split()
    if leftover:
        raise ConfigError(f"--run-config: {' '.join(leftover)!r} is not key=value "
                          "(e.g. --run-config \"algo='fedprox' fedprox.mu=0.1\")")
    for key, value in _PAIR.findall(text):  # a key given twice: the last wins, as in flwr run
        try:
            out[key] = tomli.loads(f"v = {value}")["v"]
        except tomli.TOMLDecodeError:
            number = number_in_text(value)
            if number is not None:  # .1, 1.: numbers TOML does not read (or a string, unquoted)
                raise ConfigError(f"--run-config: {key}={value} is not a TOML value: write a number with a "
                                  f"digit on each side of its point ({key}={number!r}), and quote a string "
                                  f"({key}='{value}')") from None
            raise ConfigError(
                f"--run-config: {key}={value} is not a TOML value: quote strings "
                f"({key}='{value.strip(chr(39) + chr(34))}'); numbers and true/false stay bare") from None
    return out


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false
    (any case). YAML 1.1, PyYAML's default, also reads on, off, yes, no, y
    and n as booleans, so ``cohort-batching: on`` came in as true and was
    refused as "must be a string"; here it is the string 'on'."""


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                      list("tTfF"))


def load_yaml_config(yaml_file: str) -> dict[str, Any]:
    """The run-config keys of a YAML file (nested mappings become dotted keys)."""
    try:
        with open(yaml_file, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"--config {yaml_file}: no such file") from None
    except OSError as err:
        raise ConfigError(f"--config {yaml_file}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {yaml_file}: not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config {yaml_file}: not valid YAML{at}: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {yaml_file}: must hold a mapping of run-config keys "
                          f"(key: value lines), not a {type(loaded).__name__}")
    return flat_config(loaded, f"--config {yaml_file}")


def flat_config(loaded: dict, source: str) -> dict[str, Any]:
    """Flower's ``flatten_dict`` of a config file's mapping (nested mappings
    become dotted keys), its refusals as one line naming ``source``: a key
    that is not a string (YAML's ``1: 3``), a value Flower's run config
    cannot hold (a list, a date, a null)."""
    pending = [("", loaded)]
    while pending:
        prefix, mapping = pending.pop()
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {key!r}{f' under {prefix!r}' if prefix else ''} is not a "
                                  "string; run-config keys are names such as lr or fedprox.mu")
            if isinstance(value, dict):
                pending.append((f"{prefix}.{key}" if prefix else key, value))
            elif value is None or not isinstance(value, (bool, int, float, str)):
                raise ConfigError(f"{source}: {f'{prefix}.{key}' if prefix else key}={value!r} is not a number, "
                                  "true/false or a string (quote dates and other text)")
    return flatten_dict(loaded)


def parse_overrides(tokens: list[str], run_config: str | None, yaml_file: str | None) -> dict[str, Any]:
    """Merge a YAML file, ``--run-config`` string and ``key=value`` tokens
    (later wins: a token over the string over the file, and within the
    string or the tokens a key's last value, as ``flwr run`` reads a
    ``--run-config`` string; scripts append tokens to override a base)."""
    out: dict[str, Any] = {}
    if yaml_file:
        out.update(load_yaml_config(yaml_file))
    if run_config:
        out.update(parse_run_config_string(run_config))
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"expected key=value, got {token!r} (e.g. algo='fedprox' fedprox.mu=0.1)")
        out[key.strip()] = _parse_value(value.strip())
    return out


def fuse(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``overrides``; unknown keys are an error, as in flwr run."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        hints = "".join(did_you_mean(key, defaults) for key in unknown[:1])
        raise ConfigError(
            f"unknown run-config key(s) {', '.join(unknown)}{hints}; the keys are those of "
            "[tool.flwr.app.config] in pyproject.toml (docs/config.md)")
    return {**defaults, **overrides}


def run_local(run_config: dict[str, Any], num_clients: int = DEFAULT_NUM_CLIENTS,
              quiet: bool = False, verbose: bool = False) -> Path:
    """Run the project's ServerApp and ClientApp in-process; returns the run folder.

    User errors (bad config, missing data...) raise one of
    :data:`fedaccel.errors.USER_ERRORS`, whose message is one line for the
    user, exactly as they end a ``flwr run`` as failed.
    """
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER, update_console_handler

    from fedaccel.apps.client_app import (app as client_app, client_runtime, cohort_fallback, cohort_note,
                                          prepare_clients, served_contexts, train_cohort)
    from fedaccel.clients.state import claim_state_run_dir, remove_orphaned_state_dirs, state_run_dir
    from fedaccel.apps.server_app import QUIET, RESULTS, app as server_app
    from fedaccel.local_grid import LocalGrid

    # before building anything, and before Flower's logging is changed (nothing to restore)
    cfg, _ = preflight(run_config, num_clients)
    previous_level = FLOWER_LOGGER.level
    if not verbose:
        FLOWER_LOGGER.setLevel(logging.WARNING)
    update_console_handler(colored=sys.stderr.isatty())  # no ANSI codes in a pipe or a file
    grid = None
    state_dir = str(run_config.get("state-dir", ""))
    for folder in remove_orphaned_state_dirs(state_dir):
        print(f"[fedaccel] removed {folder}: client state of a run whose process was killed", file=sys.stderr)
    try:
        grid = LocalGrid(client_app, run_config, num_clients, seed=int(run_config.get("seed", 0)))
        prepare_clients(list(grid.contexts.values()))  # every client's tensors before round 1
        first_client = served_contexts(next(iter(grid.contexts.values())))[0]
        if cfg.stateful_clients and client_runtime(first_client).state_mode == "disk":
            claim_state_run_dir(state_run_dir(state_dir, grid.run.run_id))  # its clients' state lives there
        def of_first_client(ask: Callable[[Context], Any]) -> Callable[[Context], Any]:
            # a cohort node's question goes to its first logical client (the node's own
            # context names a partition of a dataset split W ways, which no client trains on);
            # the grid's first node is slot 0, which always serves client 0
            return lambda node: ask(served_contexts(node)[0])

        grid.cohort_trainer = choose_cohort_trainer(cfg, grid, of_first_client(cohort_fallback), train_cohort,
                                                    quiet, of_first_client(cohort_note))
        context = Context(run_id=grid.run.run_id, node_id=0, node_config={QUIET: quiet},
                          state=RecordDict(), run_config=run_config)
        grid.serve(server_app, context)
    finally:
        if grid is not None:
            shutil.rmtree(state_run_dir(state_dir, grid.run.run_id), ignore_errors=True)
        FLOWER_LOGGER.setLevel(previous_level)  # the caller's logging is not ours to change
        update_console_handler(colored=True)  # Flower's default
    return Path(str(context.state[RESULTS]["run-dir"]))


def choose_cohort_trainer(cfg: RunConfig, grid: Any, fallback: Callable, trainer: Callable,
                          quiet: bool, batched_note: Callable) -> Callable | None:
    """``trainer`` (a round's clients as one batched model) when
    ``cohort-batching`` allows and the run can be batched, else None (one
    client after another, announced the same way). Says which on stderr
    when the first round trains, unless ``quiet`` (a run that stops before,
    e.g. on an unwritable results-dir, prints only its one error line),
    with what a batched run still does client by client (``batched_note``);
    ``cohort-batching='on'`` with a reason against is a :class:`ConfigError`."""
    from fedaccel.clients.cohort import unbatchable_error
    from fedaccel.errors import USER_ERRORS

    context = next(iter(grid.contexts.values()))
    try:
        reason = fallback(context)
        part = None if reason else batched_note(context)
    except USER_ERRORS:
        reason = part = None  # bad data or node config: the first round reports it, batched or not
    if reason and cfg.cohort_batching == "on":
        raise unbatchable_error(reason)
    note = (f"fedaccel: clients train one after another ({reason})" if reason else
            "fedaccel: each round's clients train as one batched model (cohort-batching)"
            + (f"; {part}" if part else ""))
    train = (lambda items: [grid.deliver(message) for message, _ in items]) if reason else trainer
    announced = [quiet]

    def announced_trainer(items: list) -> list:
        if not announced[0]:
            print(note, file=sys.stderr)
            announced[0] = True
        return train(items)

    return announced_trainer


def resume_config(where: str, overrides: dict[str, Any], num_clients: int | None) -> tuple[dict[str, Any], int]:
    """The run config and client count of the run a checkpoint continues:
    the checkpoint's own, with ``resume`` set; only keys that do not change
    the numbers (:data:`fedaccel.checkpoint.UNCHECKED_KEYS`) may be overridden."""
    from fedaccel.checkpoint import UNCHECKED_KEYS, find_checkpoint, read_manifest

    path = find_checkpoint(where)
    manifest = read_manifest(path)
    changed = sorted(set(overrides) - UNCHECKED_KEYS)
    if changed:
        raise ConfigError(f"--resume continues the run with the config it started with; drop "
                          f"{', '.join(changed)} (only {', '.join(sorted(UNCHECKED_KEYS - {'resume'}))} "
                          "may change), or start a new run")
    if num_clients is not None and num_clients != manifest["num-clients"]:
        raise ConfigError(f"--resume: the run has {manifest['num-clients']} clients; drop "
                          f"--num-clients {num_clients}")
    run_config = {**manifest["run-config"], **overrides, "resume": str(path)}
    return fuse(default_run_config(), run_config), manifest["num-clients"]


def preflight(run_config: dict[str, Any], num_clients: int) -> tuple[RunConfig, int]:
    """What a run refuses before any work (the config, cohort-batching='on'
    for a run that cannot be batched, gc.global-layers that name no layer
    of the model, the cohort size, the memory, the
    tracker): the typed config and the number of clients (``logical-clients``
    when the nodes serve that many, else ``num_clients``)."""
    from fedaccel.experiment import refuse_by_model, refuse_on_fast_runner
    from fedaccel.memory import require_memory
    from fedaccel.run_config import parse_run_config
    from fedaccel.trackers import require_tracker

    cfg = parse_run_config(run_config)
    refuse_on_fast_runner(cfg)
    refuse_by_model(cfg)
    clients = cfg.logical_clients or num_clients
    cfg.cohort_size(clients)
    require_memory(cfg, clients)
    require_tracker(cfg.tracker, cfg.tracker_uri)
    return cfg, clients


def check_run_config(run_config: dict[str, Any], num_clients: int) -> None:
    """``--check``: what a run refuses before any work (:func:`preflight`),
    then what it refuses once it looks at this machine and the data
    (:func:`check_data_and_model`), without the run: a config ``--check``
    passes is not refused by the run for its config, its device, its data
    files, its partition, its model or its optimum. Not checked: whether
    the results, state and tracker folders can be written (the run makes
    them, and says so in one line if it cannot)."""
    cfg, clients = preflight(run_config, num_clients)
    defaults = default_run_config()
    changed = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={toml_value(v)}"
                       for k, v in run_config.items() if defaults.get(k) != v)  # as flwr run's --run-config
    summary = check_data_and_model(cfg, clients)
    print(f"fedaccel-run: run config OK for {clients} clients" + (f": {changed}" if changed else " (all defaults)"))
    print(f"fedaccel-run: data and model OK: {summary}")


def check_data_and_model(cfg: RunConfig, clients: int) -> str:
    """What the run refuses once it starts, checked with the run's own code
    and in its order: the checkpoint ``resume`` names, the data (loaded and
    partitioned as the run does, not kept: missing or corrupt files, more
    clients than samples, a partition that cannot be drawn), ``device='cuda'``
    without a visible GPU (:func:`require_visible_device`), a model that
    cannot take the data's inputs and, for ``init='near-optimum'`` or
    ``optimality``, the optimum (its Newton run), both as the run's server
    builds them (:func:`fedaccel.runtime.build_model_for`, ``optimum_of``). Returns one line saying what was found (dataset, clients' training
    samples, model size). It takes what the run's own loading takes (about
    5 s for Fashion-MNIST here; minutes for a hundred thousand clients)."""
    import torch

    from fedaccel.checkpoint import find_checkpoint
    from fedaccel.data.federated import load_federated
    from fedaccel.runtime import build_model_for, data_config_for, model_name, optimum_of
    from fedaccel.torch_utils import require_visible_device

    if cfg.resume:
        find_checkpoint(cfg.resume)
    # uncached: a long-lived caller (the dashboard's Check) must not keep every dataset it checked
    dataset = load_federated.__wrapped__(data_config_for(cfg, clients))
    require_visible_device(cfg.device)  # after the data, as the run's server checks them
    with torch.random.fork_rng(devices=[]):  # nothing of the caller's seeding moves
        model = build_model_for(cfg, dataset)  # the run's own model, its near-optimum start included
        if cfg.optimality:  # the optimum the run measures against, as its server computes it
            optimum_of(cfg, dataset)
    name, sizes = model_name(cfg), dataset.train_sizes()
    parameters = sum(p.numel() for p in model.parameters())
    return (f"{dataset.name}: {sum(sizes):,} training samples over {dataset.num_clients} clients "
            f"({min(sizes):,} to {max(sizes):,} each), {len(dataset.test_y):,} test samples; "
            f"model {name} ({parameters:,} parameters) for inputs {tuple(dataset.input_shape)} "
            f"and {dataset.num_classes} classes")


EXIT_CODES_HELP = """exit codes:
  0  the run finished; its results folder is printed last
  1  a bug in fedaccel (a traceback; please report it)
  2  the command or the run config is wrong (unknown key, invalid value,
     a YAML file that is missing or malformed)
  3  the machine or the data is wrong (missing or corrupt data files,
     a results or client-state folder that cannot be written, too few samples or clients,
     not enough memory: estimated before anything is built)
  4  the run started and failed (every client of a round failed)
  130 stopped by Ctrl-C (SIGINT) or the dashboard's stop button
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedaccel-run",
        description="Run a fedaccel experiment in one process (no Ray), with flwr run's run-config keys.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run-config overrides, e.g. algo='fedprox' fedprox.mu=0.1")
    parser.add_argument("--run-config", help="overrides as one string, exactly as for flwr run")
    parser.add_argument("--config", help="a YAML file of run-config keys (nested tables allowed; configs/ has examples)")
    parser.add_argument("--num-clients", type=int, default=None,
                        help=f"simulated clients (default {DEFAULT_NUM_CLIENTS}, as local-simulation)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run from its newest checkpoint (a run folder), or from the "
                             "checkpoint file given, with the run's own config (docs/checkpoints.md)")
    parser.add_argument("--list", action="store_true", help="list the algorithms and exit")
    parser.add_argument("--check", action="store_true",
                        help="check the run config, the memory for --num-clients, the checkpoint to resume, "
                             "the data (loaded and partitioned as the run does), the device, the model and its "
                             "optimum where the run needs one, and exit without training; "
                             "flwr run drops a --run-config token that is not key=value, this refuses it")
    parser.add_argument("--quiet", action="store_true",
                        help="no per-round progress lines (the results folder is still printed)")
    parser.add_argument("--verbose", action="store_true", help="show Flower's own INFO logs")
    args = parser.parse_intermixed_args(argv)  # key=value tokens before and after options

    if args.list:
        from fedaccel.registry import describe

        for name, summary in describe():
            print(f"{name:12s} {summary}")
        return 0
    if args.num_clients is not None and args.num_clients < 1:
        parser.error("--num-clients must be >= 1")

    from fedaccel.errors import USER_ERRORS, exit_code
    from fedaccel.processes import stop_on_sigint

    try:
        overrides = parse_overrides(args.overrides, args.run_config, args.config)
        if args.resume:
            run_config, num_clients = resume_config(args.resume, overrides, args.num_clients)
        else:
            run_config = fuse(default_run_config(), overrides)
            num_clients = args.num_clients or DEFAULT_NUM_CLIENTS
        if args.check:
            check_run_config(run_config, num_clients)
            return 0
        with stop_on_sigint():
            run_local(run_config, num_clients=num_clients, quiet=args.quiet, verbose=args.verbose)
    except USER_ERRORS as err:  # one line, once, plain: the message says what to change
        print(f"fedaccel-run: error: {err}", file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:  # Ctrl-C, or the dashboard's stop button (SIGINT)
        print("fedaccel-run: stopped; the rounds finished so far are in the run folder "
              "(status.json says 'stopped')", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
