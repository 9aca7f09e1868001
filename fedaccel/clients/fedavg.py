"""FedAvg's local solver is the shared loop itself (fedaccel.clients.base.LocalSolver)."""

from fedaccel.clients.base import LocalSolver as FedAvgSolver

__all__ = ["FedAvgSolver"]
