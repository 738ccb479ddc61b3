"""stepserve: a serving engine for diffusion models built around step-level (continuous) batching."""

from .api import Engine
from .admission_errors import AdmissionError, DeadlineRefusedError, QueueFullError
from .engine import EngineCore
from .types import FinishReason, GenerationResult, RequestStatus, SamplingParams
from .validation import ValidationError
from .version import __version__

__all__ = [
    "AdmissionError",
    "DeadlineRefusedError",
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
