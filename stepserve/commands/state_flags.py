"""`stepserve serve`'s flags for what outlives a request (docs/SCALING.md, "Jobs"): the state store (--state), the
results folder (--results, --keep-results-h), the webhook secret (--webhook-secret, or STEPSERVE_WEBHOOK_SECRET),
the service the jobs belong to (--service), the jobs' lease (--job-lease-s) and attempts (--job-max-attempts). What
they ask for travels in ServeSettings; server/startup.py opens it."""

from __future__ import annotations

import argparse
import os

from ..server.startup import WEBHOOK_SECRET_ENV, StartupError
from ..store import STATE_ENV, absolute_url, default_url
from ..store.base import DEFAULT_MAX_ATTEMPTS, check_service
from .flags import float_from, int_from

DEFAULT_KEEP_H = 24.0
DEFAULT_LEASE_S = 30.0


def add_state_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("jobs and their state (see docs/SCALING.md)")
    g.add_argument("--state", default=None, metavar="URL",
                   help=f"where jobs and adapter registrations live: sqlite:///PATH (the default: state.db in the "
                        f"user's state directory, $XDG_STATE_HOME/stepserve, so a restart keeps the jobs), "
                        f"redis://HOST:PORT/DB (replicas on several machines), or memory (this process only); "
                        f"default also from {STATE_ENV}; a relative SQLite path is taken from the current folder")
    g.add_argument("--results", default=None, metavar="DIR",
                   help="folder of the jobs' results (MP4s, async images), local or shared by every replica "
                        "(default: results/ beside the SQLite state file, or in the state directory; with --state "
                        "memory a temporary folder removed at exit)")
    g.add_argument("--service", default=None, metavar="NAME",
                   help="the service this server's jobs and adapter registrations belong to: servers of one service "
                        "(replicas of one deployment) share them, others never see them (default: derived from "
                        "the model and what it serves, so that only servers that can run a job take it)")
    g.add_argument("--keep-results-h", type=float_from(0.0, False, "a positive number of hours"),
                   default=DEFAULT_KEEP_H, metavar="H",
                   help=f"finished jobs and their results are swept this many hours after they finish (default "
                        f"{DEFAULT_KEEP_H:g})")
    g.add_argument("--webhook-secret", default=None, metavar="SECRET",
                   help=f"signs the webhooks jobs send (Standard Webhooks; a 'whsec_<base64>' secret or any string; "
                        f"visible in `ps`: prefer the {WEBHOOK_SECRET_ENV} environment variable); without one, a job "
                        f"that names a webhook is refused")
    g.add_argument("--job-lease-s", type=float_from(0.0, False, "a positive number of seconds"),
                   default=DEFAULT_LEASE_S, metavar="S",
                   help=f"a running job's lease, renewed while it runs; a job whose process died is taken up by "
                        f"another once it passes (default {DEFAULT_LEASE_S:g})")
    g.add_argument("--job-max-attempts", type=int_from(1), default=DEFAULT_MAX_ATTEMPTS, metavar="N",
                   help=f"a job started this many times whose process stopped each time before it finished (out of "
                        f"memory, a crash) ends failed (too_many_attempts) instead of being run again (default "
                        f"{DEFAULT_MAX_ATTEMPTS})")


def state_settings(args: argparse.Namespace, environ=os.environ) -> dict:
    """The ServeSettings fields these flags set. StartupError for a webhook secret that is not a key."""
    from ..jobs.webhooks import WebhookSecretError, secret_key

    secret = args.webhook_secret if args.webhook_secret is not None else environ.get(WEBHOOK_SECRET_ENV) or None
    if secret is not None:
        try:
            secret_key(secret)
        except WebhookSecretError as exc:
            raise StartupError(f"--webhook-secret: {exc}") from None
    if args.service is not None:
        try:
            check_service(args.service)
        except ValueError as exc:
            raise StartupError(f"--{exc}") from None
    return {"state_url": absolute_url(args.state or default_url(environ)),
            "results_dir": os.path.abspath(args.results) if args.results else None,
            "keep_results_h": args.keep_results_h, "job_lease_s": args.job_lease_s, "webhook_secret": secret,
            "service": args.service, "job_max_attempts": args.job_max_attempts}
