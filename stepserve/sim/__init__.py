"""Discrete-event simulation: the real EngineCore and policies, a simulated clock, the fake executor."""

from .loop import Arrival, SimLoop
from .run import SimulationResult, simulate

__all__ = ["Arrival", "SimLoop", "SimulationResult", "simulate"]
