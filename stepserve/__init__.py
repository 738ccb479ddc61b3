"""stepserve: a serving engine for diffusion models built around step-level (continuous) batching."""

from .api import Engine, GenerationResult
from .engine import EngineCore, QueueFullError
from .types import FinishReason, RequestStatus, SamplingParams
from .validation import ValidationError

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "EngineCore",
    "FinishReason",
    "GenerationResult",
    "QueueFullError",
    "RequestStatus",
    "SamplingParams",
    "ValidationError",
    "__version__",
]
