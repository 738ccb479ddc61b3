"""Starting the server's engine: the same in one process (`stepserve serve`) and in every Ray Serve replica
(ray/deployment.py). ServeSettings is what the serve flags ask for, as plain data that can travel to a replica."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from ..store.base import DEFAULT_MAX_ATTEMPTS
from ..util.api_key import API_KEY_ENV, resolve_api_key
from ..util.urls import has_password, without_password

WEBHOOK_SECRET_ENV = "STEPSERVE_WEBHOOK_SECRET"

from ..engine.config import EngineConfig, build_engine
from .schemas import ServerLimits


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineConfig  # what to load and how it batches (max_batch_size before the memory cap)
    limits: ServerLimits  # per-request limits of the HTTP API
    api_key: str | None = field(default=None, repr=False)  # required as a bearer token on every route but /health
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str | None = None  # where the key came from, when from a file (replicas read it there)
    cors_origins: tuple[str, ...] = ()  # web origins allowed to call the API from a browser
    api_key_required: bool = False  # a replica: a key must be found where it starts (never travels in here)
    access_log: bool = True  # one line per image or video request (a replica leaves it to Ray Serve, which logs each)
    state_url: str = field(default="memory", repr=False)  # the state store: each process opens it itself (shown
    # anywhere only through without_password: it may carry the store's password)
    results_dir: str | None = None  # the jobs' results; None: results/ in the state directory (memory: a temporary one)
    keep_results_h: float = 24.0  # finished jobs and their files are swept this long after they finish
    job_lease_s: float = 30.0  # a running job's lease (a dead process's jobs are taken up once it passes)
    webhook_secret: str | None = field(default=None, repr=False)  # signs webhooks (never travels to a replica)
    webhook_secret_required: bool = False  # a replica: the secret must be found where it starts
    service: str | None = None  # the service of the jobs and registrations; None: derived from the model served
    job_max_attempts: int = DEFAULT_MAX_ATTEMPTS  # a job claimed this many times without finishing ends failed
    webhook_allow: tuple[str, ...] = ()  # internal receivers webhooks may reach (--webhook-allow; jobs/targets.py)
    allowed_hosts: tuple[str, ...] = ()  # Host names served without an API key besides the address's own (hosts.py)
    state_password_required: bool = False  # a replica: the state URL's password is in its own STEPSERVE_STATE


def for_replicas(settings: ServeSettings) -> ServeSettings:
    """The settings that travel to Ray Serve replicas: without the key, the webhook secret and the state URL's
    password (deployment arguments are pickled and stored by Ray). Each replica finds them where it starts:
    replica_api_key(), replica_webhook_secret(), replica_state_url()."""
    if has_password(settings.state_url):
        settings = replace(settings, state_url=without_password(settings.state_url), state_password_required=True)
    if settings.api_key is not None:
        settings = replace(settings, api_key=None, api_key_required=True)
    if settings.webhook_secret is not None:
        settings = replace(settings, webhook_secret=None, webhook_secret_required=True)
    return settings


def replica_api_key(settings: ServeSettings) -> str | None:
    """In a replica: the key from --api-key-file (a path the replica's node can read), else from its own
    STEPSERVE_API_KEY environment variable (a local cluster inherits `serve`'s). A key was set but none is found
    here: StartupError, so that no replica ever serves without it."""
    if not settings.api_key_required:
        return settings.api_key
    try:
        key = resolve_api_key(None, settings.api_key_file, os.environ)
    except ValueError as exc:
        raise StartupError(f"the replica cannot read the API key: {exc}") from None
    if key is None:
        raise StartupError(f"the server requires an API key but this replica finds none: set {API_KEY_ENV} where "
                           f"the Ray cluster starts, or give --api-key-file on a path every node can read")
    return key


def replica_webhook_secret(settings: ServeSettings) -> str | None:
    """In a replica: the webhook secret from its own STEPSERVE_WEBHOOK_SECRET (a local cluster inherits `serve`'s);
    StartupError when one was set for the server but this replica finds none."""
    if not settings.webhook_secret_required:
        return settings.webhook_secret
    secret = os.environ.get(WEBHOOK_SECRET_ENV) or None
    if secret is None:
        raise StartupError(f"the server signs webhooks but this replica finds no secret: set {WEBHOOK_SECRET_ENV} "
                           f"where the Ray cluster starts")
    return secret


def results_folder(settings: ServeSettings):
    """Where the results go: --results, else results/ beside a SQLite state file, else in the user's state
    directory (Redis); None for --state memory without --results (a temporary folder)."""
    from ..store import sqlite_path, state_dir

    if settings.results_dir is not None:
        return settings.results_dir
    if settings.state_url == "memory":
        return None
    path = sqlite_path(settings.state_url)
    return path.parent / "results" if path is not None else state_dir() / "results"


def job_options(settings: ServeSettings) -> dict:
    """create_app's arguments for the jobs that the settings give (the same for `serve` and every replica)."""
    return {"job_lease_s": settings.job_lease_s, "service": settings.service,
            "job_max_attempts": settings.job_max_attempts}


def replica_state_url(settings: ServeSettings) -> str:
    """The state URL to open: the settings' own, or in a replica of a server whose URL has a password, its own
    STEPSERVE_STATE (a local cluster inherits `serve`'s), which must name the same store. StartupError otherwise."""
    from ..store import STATE_ENV

    if not settings.state_password_required:
        return settings.state_url
    url = os.environ.get(STATE_ENV) or ""
    if without_password(url) != settings.state_url:
        raise StartupError(f"the server's state {settings.state_url} has a password but this replica finds none: set "
                           f"{STATE_ENV} to the whole URL where the Ray cluster starts")
    return url


def open_state(settings: ServeSettings):
    """(the state store, the results folder) the settings name; StartupError in one line when either cannot be
    opened (the URL shown without its password). Memory: a temporary results folder unless --results names one
    (removed at close() then). A SQLite file's missing folder is created, with a line that says so."""
    from ..store import open_store, sqlite_path
    from ..store.results import Results

    path = sqlite_path(settings.state_url)
    missing = path is not None and not path.parent.exists()
    try:
        store = open_store(replica_state_url(settings))
    except (ValueError, ImportError, OSError) as exc:  # StoreError and a missing extra are ValueErrors
        raise StartupError(f"--state {without_password(settings.state_url)}: {exc}") from None
    if missing:
        say(f"created the folder {path.parent} for the state file")
    keep_s = settings.keep_results_h * 3600.0
    folder = results_folder(settings)
    try:
        if folder is None:
            return store, Results.in_temporary_folder(keep_s)
        return store, Results(folder, keep_s)
    except OSError as exc:
        store.close()
        raise StartupError(f"--results {folder}: cannot use the folder: {exc.strerror or exc}") from None


def state_line(settings: ServeSettings, results_root, replicas: bool = False, service: str | None = None) -> str:
    """What the start-up says of the state: which store, which results folder, how long results are kept, and
    the service the jobs belong to."""
    where = "a temporary folder" if settings.results_dir is None and settings.state_url == "memory" else results_root
    shown = without_password(settings.state_url)
    line = f"jobs: state {shown}, results in {where} (kept {settings.keep_results_h:g} h)"
    if settings.state_url == "memory":
        line += (" - warning: with --state memory each replica keeps its own jobs and adapters (a poll that reaches "
                 "another replica finds nothing); give --state sqlite:///PATH or redis://..." if replicas else
                 "; nothing survives a restart")
    service = service or settings.service
    return f"{line}; service {service}" if service else line


class StartupError(Exception):
    """A flag or model that cannot be served; its message is the one-line error `stepserve serve` prints."""


def say(line: str) -> None:
    print(f"stepserve serve: {line}", file=sys.stderr, flush=True)


def start_engine(config: EngineConfig, **engine_args):
    """An AsyncEngine (not yet started) over what `config` names (`engine_args`: AsyncEngine's, e.g. the shared
    device of a server of several models). Raises StartupError with a one-line message."""
    from ..engine.async_engine import AsyncEngine
    from ..engine.loading import check_model_argument

    try:
        check_model_argument(config.model)  # a one-line error before anything loads
    except FileNotFoundError as exc:
        raise StartupError(f"--{exc}") from None
    weights = f", {config.weights.summary()}" if config.weights is not None and config.weights.changed else ""
    say(f"loading {config.model} on {config.device} ({config.dtype}{weights}, backend {config.backend}) ...")
    try:
        built = build_engine(config, say)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load model {config.model!r}: {exc}") from None
    engine = AsyncEngine(built.executor, options=built.options, **engine_args)
    warning = video_warning(engine.model_info)
    if warning:
        say(warning)
    return engine


def video_warning(info) -> str | None:
    """A video model on a machine without the `video` extra serves images, but every POST /v1/videos would be a
    501: one line at start-up says so, before any work is sent. None when there is nothing to say."""
    from .mp4 import EncoderMissing, check_encoder

    if not info.video:
        return None
    try:
        check_encoder()
    except EncoderMissing as exc:
        return (f"warning: {info.name} makes videos, but {exc}; until then POST /v1/videos answers 501 (images "
                f"are served)")
    return None


def base_url(host: str, port: int) -> str:
    """The server's address for a person to open: an any-address host (0.0.0.0, ::) as localhost."""
    shown = "localhost" if host in ("", "0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def ready_line(model: str, host: str, port: int, details: str) -> str:
    """The line that says the server is up: where the API is, and the console (the web page at /)."""
    url = base_url(host, port)
    return f"{model} on {url}/v1 ({details}); console: {url}/"
