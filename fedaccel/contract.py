"""The messages between server and client, declared once per local solver.

A training round is one message each way. Every algorithm's messages share a
core: the server sends the model (record ``arrays``) and a ``config`` record
with :data:`TRAIN_CONFIG_KEYS`; the client replies with its ``arrays`` and a
``metrics`` record. An algorithm may add ArrayRecords in either direction
(SCAFFOLD's control variates, FedPM's preconditioners) and config values
(FedProx's ``proximal-mu``); it declares them in a :class:`MessageContract` on
its solver class (:attr:`fedaccel.clients.base.LocalSolver.messages`), and its strategy
refers to that same object. Both sides check a message against it, so a wrong
or missing key is one error naming the algorithm and the key:

- the client refuses a training message that lacks a declared record or
  config value (an error reply the server logs, naming node and cause), and a
  reply its own solver built with an undeclared record (a bug);
- the server refuses to send an undeclared record or config value (a bug),
  and rejects a reply that lacks a declared record or carries an unknown one
  (logged, the round goes on with the other replies).

A mismatch in the field is typically a device running another fedaccel
version than the server; the message says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

MODEL_RECORD = "arrays"  # the model, both ways
METRICS_RECORD = "metrics"  # the reply's metrics
CONFIG_RECORD = "config"  # the training message's config values

# Config values every training message carries (Flower's FedAvg adds server-round).
TRAIN_CONFIG_KEYS = ("server-round", "lr", "local-epochs")
# Sent to stateful algorithms' clients only: the commit protocol (docs/client-state.md).
ACCEPTED_ROUND = "accepted-round"
# Ends every contract error: in the field a mismatch means two versions.
VERSIONS_HINT = " (do the server and this client run the same fedaccel version?)"


class ContractError(ValueError):
    """A message does not match its algorithm's :class:`MessageContract`."""


@dataclass(frozen=True)
class TrainConfig:
    """The typed config of one training message (server -> client)."""

    server_round: int
    lr: float
    local_epochs: int
    accepted_round: int | None  # None: not a stateful algorithm
    values: Mapping[str, Any]  # the algorithm's declared extra values, by key

    def get(self, key: str) -> Any:
        """A declared extra value (always present once the message was read)."""
        return self.values[key]


@dataclass(frozen=True)
class MessageContract:
    """What an algorithm adds to the common training messages.

    ``to_client``: ArrayRecords the server sends beside the model;
    ``to_server``: ArrayRecords a client replies beside its weights;
    ``config``: config values beyond :data:`TRAIN_CONFIG_KEYS`.
    """

    to_client: tuple[str, ...] = ()
    to_server: tuple[str, ...] = ()
    config: tuple[str, ...] = ()

    # ----------------------------------------------------------- both sides
    def records_problem(self, algorithm: str, direction: str, names: Iterable[str]) -> str | None:
        """Why ArrayRecord ``names`` (beside the model) break the contract in
        ``direction`` (``to_client`` or ``to_server``), or None."""
        declared = getattr(self, direction)
        names = [n for n in names if n != MODEL_RECORD]
        missing = [n for n in declared if n not in names]
        unknown = [n for n in names if n not in declared]
        where = "training message" if direction == "to_client" else "reply"
        if missing:
            return (f"{algorithm}: the {where} lacks the record {missing[0]!r} that {algorithm}'s "
                    f"message contract declares{VERSIONS_HINT}")
        if unknown:
            return (f"{algorithm}: the {where} carries the record {unknown[0]!r}, which {algorithm}'s "
                    f"message contract does not declare (declared: {_listing(declared)}){VERSIONS_HINT}")
        return None

    def check_records(self, algorithm: str, direction: str, names: Iterable[str]) -> None:
        """Raise :class:`ContractError` if ``names`` break the contract."""
        problem = self.records_problem(algorithm, direction, names)
        if problem is not None:
            raise ContractError(problem)

    def check_config_keys(self, algorithm: str, keys: Iterable[str], stateful: bool) -> None:
        """Raise :class:`ContractError` for a missing or undeclared config value."""
        keys = list(keys)
        required = list(TRAIN_CONFIG_KEYS) + list(self.config) + ([ACCEPTED_ROUND] if stateful else [])
        allowed = set(required) | {ACCEPTED_ROUND}  # required when stateful, tolerated otherwise
        for key in required:
            if key not in keys:
                raise ContractError(f"{algorithm}: the training message's config lacks {key!r}, which "
                                    f"{algorithm}'s message contract requires{VERSIONS_HINT}")
        for key in keys:
            if key not in allowed:
                raise ContractError(f"{algorithm}: the training message's config carries {key!r}, which "
                                    f"{algorithm}'s message contract does not declare "
                                    f"(declared: {_listing(required)}){VERSIONS_HINT}")

    # ---------------------------------------------------------- client side
    def read_train_config(self, algorithm: str, config: Mapping[str, Any], stateful: bool) -> TrainConfig:
        """The typed :class:`TrainConfig` of a received training message."""
        self.check_config_keys(algorithm, config.keys(), stateful)
        accepted = config.get(ACCEPTED_ROUND)
        return TrainConfig(
            server_round=int(config["server-round"]),
            lr=float(config["lr"]),
            local_epochs=int(config["local-epochs"]),
            accepted_round=None if accepted is None else int(accepted),
            values={key: config[key] for key in self.config},
        )


# FedAvg's contract: nothing beyond the common messages (the default of both sides).
NO_EXTRAS = MessageContract()


def train_config_record(server_round: int, lr: float, local_epochs: int,
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A training message's config values as the server sends them (for
    callers that drive a solver directly, e.g. tests and benchmarks)."""
    return {"server-round": server_round, "lr": lr, "local-epochs": local_epochs, **dict(extra or {})}


def _listing(keys: Iterable[str]) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys) if keys else "none"
