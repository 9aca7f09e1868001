"""Errors a user can cause and fix; apps show them as one line, not a traceback.

Each kind has one exit code in ``fedaccel-run`` (documented in the README):

- 2: the command or the run config is wrong (unknown key, invalid value, a
  YAML file that is missing or malformed, a model that does not fit the data);
- 3: the machine or the data is wrong (missing or corrupt data files, a
  results or client-state folder that cannot be written, too few clients for the run, not
  enough memory, a missing or damaged checkpoint);
- 4: the run started and failed (every client of a round failed).

Anything else is a bug in fedaccel: exit code 1 with a traceback.
"""

from fedaccel.data import DataError
from fedaccel.config import ConfigError
from fedaccel.models import ModelError


class FederationError(RuntimeError):
    """The clients could not be discovered (missing nodes, bad node config)."""


class ResultsDirError(RuntimeError):
    """The results folder cannot be created or written."""


class StateDirError(RuntimeError):
    """A folder of the clients' disk state (``state-dir``) cannot be created."""


class ResourceError(RuntimeError):
    """The run cannot fit in this machine (memory), said before anything is built."""


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing, damaged or unusable here."""


class RoundFailedError(RuntimeError):
    """Every client of a round failed; continuing would silently freeze the model."""


class RejectedReplies(Exception):
    """Raised by a strategy's ``combine`` when some of the replies it was
    given cannot be combined, found only while combining them (FedPM: a
    preconditioner without a Cholesky factor): ``problems`` maps each such
    reply's index in the list ``combine`` got to the reason. The round
    rejects those replies as it rejects malformed ones and calls ``combine``
    again with the others (``FedAccelStrategy.aggregate_train``), so a
    ``combine`` that keeps server state must raise it before it changes any
    (FedPM's keeps none)."""

    def __init__(self, problems: dict[int, str]) -> None:
        super().__init__("; ".join(f"reply {i}: {why}" for i, why in sorted(problems.items())))
        self.problems = problems


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DataError, ModelError, FederationError, ResultsDirError, StateDirError, ResourceError,
    CheckpointError, RoundFailedError,
)

EXIT_CODES: dict[type[BaseException], int] = {
    ConfigError: 2, ModelError: 2,
    DataError: 3, FederationError: 3, ResultsDirError: 3, StateDirError: 3, ResourceError: 3, CheckpointError: 3,
    RoundFailedError: 4,
}


def exit_code(err: BaseException) -> int:
    """The documented exit code of a user error (1 for anything else)."""
    for kind, code in EXIT_CODES.items():
        if isinstance(err, kind):
            return code
    return 1
