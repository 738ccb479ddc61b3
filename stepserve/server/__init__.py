"""The HTTP front end: an OpenAI-compatible images API over the AsyncEngine (see docs/HTTP_API.md)."""

from .app import create_app
from .schemas import ServerLimits

__all__ = ["ServerLimits", "create_app"]
