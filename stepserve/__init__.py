"""stepserve: a serving engine for diffusion models built around step-level (continuous) batching."""

from .api import Engine
from .engine.admission_errors import AdmissionError, DeadlineRefusedError, QueueFullError
from .engine.core import EngineCore
from .request.types import FinishReason, GenerationResult, RequestStatus, SamplingParams
from .request.validation import ValidationError
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
