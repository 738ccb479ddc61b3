"""What the runner needs to know of a kind of job (a video, an async image request): the server implements these
(server/video_jobs.py, server/image_jobs.py), the runner calls them, so the runner itself knows nothing of HTTP.

A job's input files (an edit's pictures) are named in `job.request["inputs"]` ({role: file name in the results
folder}); its output files in `job.results`. `job_files` gives both: what DELETE and the sweep remove.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..request.types import GenerationResult, SamplingParams
from ..store.base import JobRecord


@dataclass
class JobError(Exception):
    """Why a job failed: its `error` as clients read it ({"code", "message"}), and the outcome the server's metrics
    and access log count it as (invalid, timeout, failed, ...)."""

    code: str
    message: str
    outcome: str = "failed"

    def __str__(self) -> str:
        return self.message

    def as_error(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class JobKind(Protocol):
    name: str  # the store's kind: "video" or "image"
    event: str  # the prefix of its events and webhook types: "video" -> video.completed

    async def params(self, job: JobRecord) -> list[SamplingParams]:
        """The engine requests of the job, from its stored request (the same on every run). Raises JobError."""

    def error_of(self, result: GenerationResult) -> JobError | None:
        """The failure a finished engine request stands for; None when it completed."""

    async def finish(self, job: JobRecord, results: Sequence[GenerationResult]) -> dict[str, bytes]:
        """The files the job leaves (name -> bytes) once every request completed. Raises JobError."""

    async def describe(self, job: JobRecord) -> dict[str, Any]:
        """The job as GET answers it (and a webhook's `data`)."""

    def ended(self, job: JobRecord, outcome: str, results: Sequence[GenerationResult]) -> None:
        """Told once per job, by the process that ran it (or that deleted it before anyone did): metrics, the
        access log."""


def job_files(job: JobRecord) -> list[str]:
    return [*job.results, *(job.request.get("inputs") or {}).values()]
