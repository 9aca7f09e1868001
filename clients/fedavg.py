"""FedAvg's local solver is the shared loop itself (clients.base.LocalSolver)."""

from clients.base import LocalSolver as FedAvgSolver

__all__ = ["FedAvgSolver"]
