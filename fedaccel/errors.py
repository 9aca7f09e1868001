"""Errors a user can cause and fix; apps show them as one line, not a traceback."""

from data import DataError
from fedaccel.config import ConfigError
from models import ModelError


class FederationError(RuntimeError):
    """The clients could not be discovered (missing nodes, bad node config)."""


class RoundFailedError(RuntimeError):
    """Every client of a round failed; continuing would silently freeze the model."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DataError, ModelError, FederationError, RoundFailedError,
)
