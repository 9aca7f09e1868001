"""The launch form: generated from the registry and the run-config schema,
validated by the very code that validates ``--run-config``.

Fields are the keys of ``[tool.flwr.app.config]`` (pyproject.toml: the
defaults and their types), the allowed values of
:data:`fedaccel.run_config.CHOICES` and the registry's algorithm names, and
the help text of the key tables in docs/config.md. Values typed into the form
become a run config exactly as ``fedaccel-run key=value`` tokens do, and go
through :func:`fedaccel.local_run.fuse` and
:func:`fedaccel.run_config.parse_run_config`: the same checks, the same
one-line messages.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from fedaccel.errors import USER_ERRORS
from fedaccel.local_run import (DEFAULT_NUM_CLIENTS, _parse_value, check_data_and_model, default_run_config, fuse,
                                preflight, project_dir, run_config_tokens)
from fedaccel.experiment import refuse_on_flower
from fedaccel.registry import all_algorithms, describe
from fedaccel.run_config import CHOICES, parse_run_config
from fedaccel.trackers import require_tracker

#: keys the dashboard sets itself: where launched runs go
DASHBOARD_KEYS = frozenset({"results-dir", "resume"})

_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*(.*)\|\s*$")


@cache
def _doc_help(mtime: float | None = None) -> dict[str, str]:
    """``key -> meaning`` from every key table of docs/config.md (backticks
    dropped); empty when the docs are not next to the package."""
    path = project_dir() / "docs" / "config.md"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        match = _ROW.match(line)
        if match:
            out[match.group(1)] = match.group(3).replace("`", "").strip()
    return out


def doc_help() -> dict[str, str]:
    path = project_dir() / "docs" / "config.md"
    return _doc_help(path.stat().st_mtime if path.exists() else None)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str"


def form_schema() -> dict[str, Any]:
    """Every field of the launch form, grouped: shared keys, ``synthetic.*``,
    ``gc.*`` and each algorithm's own keys (shown for that algorithm only)."""
    defaults = default_run_config()
    specs = all_algorithms()
    prefixes = {spec.prefix: name for name, spec in specs.items()}
    help_text = doc_help()
    fields = []
    for key, default in defaults.items():
        if key in DASHBOARD_KEYS:
            continue
        head, dot, _ = key.partition(".")
        group = ("algo:" + head) if dot and head in prefixes else (head if dot else "shared")
        choices = list(CHOICES.get(key, ()))
        if key == "algo":
            choices = list(specs)
        fields.append({"key": key, "default": default, "kind": "choice" if choices else _kind(default),
                       "choices": choices, "group": group, "help": help_text.get(key, "")})
    algorithms = [{"name": name, "summary": summary, "prefix": specs[name].prefix}
                  for name, summary in describe()]
    return {"fields": fields, "algorithms": algorithms, "default_num_clients": DEFAULT_NUM_CLIENTS}


def value_of(key: str, text: Any, default: Any) -> Any:
    """A form value as the run config holds it: booleans and JSON numbers as
    they come; text as ``fedaccel-run key=value`` reads it (TOML, a bare word
    is a string), except that a key whose default is a word keeps any text
    as a string (``run-name=123`` is the folder "123"), but for ``auto``
    keys that take a number too (``clip-norm``)."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    if isinstance(default, str) and not (default == "auto" and key not in CHOICES):
        return text
    return _parse_value(text)


class FormError(ValueError):
    """A launch request that cannot run: ``key`` names the field (or None)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _key_of(message: str) -> str | None:
    match = (re.search(r"invalid run config: ([\w.-]+)=", message) or re.search(r"key\(s\) ([\w.-]+)", message)
             or re.match(r"(cohort-batching)='on' but", message)
             or re.match(r"(model): ", message)  # a model that cannot take the data (Check's model build)
             or re.search(r"\((data-dir)=", message))  # data files not found where data-dir says
    if match is None and re.match(r"(num-clients=|partition=.* leaves \d+ of the)", message):
        return "num_clients"  # too many clients for the data: the form's clients field
    return match.group(1) if match else None


def overrides_from_form(values: dict[str, Any]) -> dict[str, Any]:
    """The keys of a submitted form that differ from pyproject's defaults,
    as run-config values. Unknown keys are refused as ``fedaccel-run`` does."""
    defaults = default_run_config()
    out = {}
    for key, text in values.items():
        if key in DASHBOARD_KEYS:
            raise FormError(f"{key} is set by the dashboard (runs go to its first results folder)", key)
        default = defaults.get(key)
        value = value_of(key, text, default)
        # "0" in a float field is its default 0.0 (the reader makes floats of them); in
        # clients-per-round, 1.0 is not 1 (all clients vs one)
        same_type = type(value) is type(default) or (
            isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool))
        if key not in defaults or value != default or not same_type:
            out[key] = value
    return out


def validate(values: dict[str, Any], num_clients: int, engine: str = "fast",
             data: bool = False) -> dict[str, Any]:
    """The run-config overrides of a valid form, or :class:`FormError` with
    the message ``fedaccel-run`` / ``flwr run`` would give. ``data``: for the
    fast runner, also what ``fedaccel-run --check`` checks beyond that (the
    device, the data loaded and partitioned, the model:
    :func:`fedaccel.local_run.check_data_and_model`)."""
    try:
        overrides = overrides_from_form(values)
        run_config = fuse(default_run_config(), overrides)
        if engine == "fast":  # all fedaccel-run refuses before any work
            cfg, clients = preflight(run_config, num_clients)
            if data:
                check_data_and_model(cfg, clients)
        else:  # what flwr run's server refuses before it asks any node
            cfg = parse_run_config(run_config)
            require_tracker(cfg.tracker, cfg.tracker_uri)
            refuse_on_flower(cfg)
            if cfg.logical_clients:  # the clients are known without the nodes
                cfg.cohort_size(cfg.logical_clients)
    except FormError:
        raise
    except USER_ERRORS as err:
        raise FormError(str(err), _key_of(str(err))) from None
    return overrides


__all__ = ["FormError", "form_schema", "validate", "run_config_tokens", "value_of"]
