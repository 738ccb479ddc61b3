"""Discrete-event simulation: the real EngineCore and policies, a simulated clock, a fake executor."""

from .run import Arrival, SimulationResult, simulate

__all__ = ["Arrival", "SimulationResult", "simulate"]
