"""A finished job's webhook: one POST of its payload, signed as the Standard Webhooks specification says, retried
with backoff until a 2xx or until the retries end, its state kept on the job in the state store.

Signing (https://www.standardwebhooks.com): every attempt carries
- `webhook-id`: "msg_<job id>", the same on every attempt and on every process (receivers drop repeats by it);
- `webhook-timestamp`: the attempt's time, whole seconds since the epoch;
- `webhook-signature`: "v1," + base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}")), body the exact bytes sent.
The key: a secret "whsec_<base64>" (the specification's form) is its base64-decoded bytes; any other secret is
its UTF-8 bytes (a receiver using a Standard Webhooks library then gives it "whsec_" + base64 of those bytes).
A server with no secret sends nothing unsigned: a job that names a webhook there is refused at creation
(`require_secret`), and a delivery without a secret is recorded failed without a POST.

Delivery: a 2xx is success. Anything else (redirects are not followed), a timeout or a connection error is
retried after the next of `delays_s`; when they are used up the delivery is failed (the job stays completed).
Before every attempt the job is read again: a delivery that is no longer pending (delivered, failed) or that
another process has taken over is never posted again. The job's webhook state, as GET shows it: {"url",
"state": "pending" | "delivered" | "failed", "attempts", "last_error", "delivered_at"}.

A process that dies mid-delivery leaves it pending. The sender holds the finished job's lease while it tries
(renewed as a job's is); `resume` takes up pending deliveries whose lease has passed, and sends the same body
(kept in the job's meta at the first attempt) under the same webhook-id.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from ..store.base import JobRecord, Store

log = logging.getLogger("stepserve.jobs")
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
SECRET_PREFIX = "whsec_"
BODY, SENDER = "webhook_body", "webhook_sender"  # the job's meta: the payload as first sent, who is sending it
RESUME_SCAN = 1000  # the newest jobs looked at for deliveries left pending

Post = Callable[[str, bytes, dict[str, str]], Awaitable[int]]  # (url, body, headers) -> HTTP status


class WebhookSecretError(ValueError):
    """No secret, or one that is not a key (a "whsec_" secret that is not base64): what to give instead."""


class WebhookVerificationError(ValueError):
    """A delivery whose headers or signature do not check out; the message says which."""


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret: "whsec_<base64>" decoded, any other its UTF-8 bytes."""
    if not isinstance(secret, str) or not secret:
        raise WebhookSecretError("the webhook secret is empty; give a \"whsec_<base64>\" secret (or any non-empty "
                                 "string)")
    if secret.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
        except (binascii.Error, ValueError):
            raise WebhookSecretError("the webhook secret starts with whsec_ but the rest is not base64; allowed: "
                                     "\"whsec_\" + base64 of the key's bytes, or a secret without that prefix") from None
        if not key:
            raise WebhookSecretError("the webhook secret \"whsec_\" holds no key")
        return key
    return secret.encode()


def require_secret(secret: str | None) -> None:
    """For a job's creation that names a webhook: WebhookSecretError (a 400 naming `webhook`) on a server without
    a secret, since nothing is sent unsigned."""
    if not secret:
        raise WebhookSecretError("webhook: this server has no webhook secret, and webhooks are only sent signed; "
                                 "start it with --webhook-secret or STEPSERVE_WEBHOOK_SECRET, or leave webhook out")
    secret_key(secret)


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature of one attempt: "v1,<base64 HMAC-SHA256>" over "{msg_id}.{timestamp}.{body}"."""
    signed = f"{msg_id}.{int(timestamp)}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: float = 300,
           now: float | None = None) -> None:
    """Check a delivery as a receiver does; WebhookVerificationError says what failed: a header missing, a
    timestamp more than `tolerance_s` from `now` (a replay, or a clock far off), or no signature that matches
    (any of the space-separated "v1,..." entries may)."""
    lower = {k.lower(): v for k, v in headers.items()}
    missing = [h for h in ("webhook-id", "webhook-timestamp", "webhook-signature") if not lower.get(h)]
    if missing:
        raise WebhookVerificationError(f"missing header(s): {', '.join(missing)}")
    try:
        timestamp = int(lower["webhook-timestamp"])
    except ValueError:
        raise WebhookVerificationError(f"webhook-timestamp {lower['webhook-timestamp'][:40]!r} is not whole "
                                       f"seconds since the epoch") from None
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        raise WebhookVerificationError(f"webhook-timestamp is {now - timestamp:+.0f} s from now; at most "
                                       f"{tolerance_s:g} s either way")
    expected = sign(secret, lower["webhook-id"], timestamp, body)
    if not any(hmac.compare_digest(given.encode(), expected.encode()) for given in lower["webhook-signature"].split()):
        raise WebhookVerificationError("no v1 signature matches the body with this secret")


class WebhookSender:
    def __init__(self, store: Store, secret: str | None, delays_s=(1, 2, 4, 8, 16, 32, 64), timeout_s: float = 10.0,
                 post: Post | None = None, lease_s: float = 30.0,
                 payload_of: Callable[[JobRecord], dict] | None = None) -> None:
        """`post`: send one attempt (default: an httpx client that follows no redirect); `lease_s`: how long a
        dead sender's deliveries wait before `resume` takes them; `payload_of`: the payload of a pending delivery
        whose first attempt never ran (default: the job's id, kind, status and error)."""
        if secret is not None:
            secret_key(secret)  # a malformed secret fails at start, not at the first delivery
        self.store, self.secret, self.delays_s, self.timeout_s = store, secret, tuple(delays_s), timeout_s
        self.lease_s = lease_s
        self.payload_of = payload_of or _minimal_payload
        self._post = post
        self._client = None
        self._tasks: set[asyncio.Task] = set()

    async def deliver(self, job: JobRecord, payload: dict, owner: str) -> None:
        """POST json(payload) to job.webhook["url"] until a 2xx, or until the retries end (see the module)."""
        if await self._claim(job.id, owner, _encode(payload)) is not None:
            await self._attempts(job.id, owner)

    async def resume(self, owner: str) -> None:
        """Deliveries left pending by a process that died (a finished job whose webhook is pending and whose lease
        has passed): claim each, holding its lease while trying, and deliver it."""
        jobs, now = await asyncio.to_thread(lambda: (self.store.list_jobs(None, RESUME_SCAN), self.store.now()))
        left = [j for j in jobs if j.finished and _pending(j) and j.lease_until < now]
        tasks = [asyncio.ensure_future(self._resume_one(j, owner)) for j in left]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            self._tasks.difference_update(tasks)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- one delivery ----------------------------------------------------------------------------------------
    async def _resume_one(self, job: JobRecord, owner: str) -> None:
        body = job.meta.get(BODY)
        body = body.encode() if isinstance(body, str) else _encode(self.payload_of(job))
        if await self._claim(job.id, owner, body, taking_over=True) is not None:
            log.info("job %s: taking up its webhook delivery left pending by %s", job.id, job.meta.get(SENDER))
            await self._attempts(job.id, owner)

    async def _claim(self, job_id: str, owner: str, body: bytes, taking_over: bool = False) -> JobRecord | None:
        """Make `owner` the job's sender (its body kept for a resume), unless the delivery is over or another
        live sender holds it; read back, since the store has no compare-and-set for a finished job."""
        def claim() -> JobRecord | None:
            job = self.store.get_job(job_id)
            if job is None or not _pending(job):
                return None
            held = job.lease_until >= self.store.now()  # by a live sender, or by the runner that just ended it
            if held and (taking_over or job.meta.get(SENDER) not in (None, owner)):
                return None
            meta = {**job.meta, SENDER: owner, BODY: job.meta.get(BODY) or body.decode()}
            self.store.update_job(job_id, meta=meta, lease_until=self.store.now() + self.lease_s)
            again = self.store.get_job(job_id)
            return again if again is not None and again.meta.get(SENDER) == owner else None

        return await asyncio.to_thread(claim)

    async def _attempts(self, job_id: str, owner: str) -> None:
        for i in range(len(self.delays_s) + 1):
            job = await asyncio.to_thread(self._mine, job_id, owner)
            if job is None:
                return  # delivered, failed, deleted, or taken over by another process
            hook, body, msg_id = job.webhook, job.meta[BODY].encode(), f"msg_{job_id}"
            if not self.secret:
                await self._record(job_id, owner, hook, FAILED, "no webhook secret: nothing is sent unsigned",
                                   posted=False)
                return
            error = await self._send(hook["url"], msg_id, body)
            last = i == len(self.delays_s)
            state = DELIVERED if error is None else FAILED if last else PENDING
            await self._record(job_id, owner, hook, state, error)
            if state != PENDING:
                if state == FAILED:
                    log.warning("job %s: webhook not delivered after %d attempts: %s", job_id, i + 1, error)
                return
            await self._hold(job_id, owner, self.delays_s[i])

    def _mine(self, job_id: str, owner: str) -> JobRecord | None:
        job = self.store.get_job(job_id)
        return job if job is not None and _pending(job) and job.meta.get(SENDER) == owner else None

    async def _send(self, url: str, msg_id: str, body: bytes) -> str | None:
        """One attempt; None on a 2xx, else what went wrong."""
        stamp = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "stepserve-webhooks", "webhook-id": msg_id,
                   "webhook-timestamp": str(stamp), "webhook-signature": sign(self.secret, msg_id, stamp, body)}
        try:
            status = await (self._post or self._http_post)(url, body, headers)
        except Exception as exc:  # noqa: BLE001 - every failure to get an answer is retried
            import httpx

            if isinstance(exc, httpx.TimeoutException):
                return f"no answer within {self.timeout_s:g} s"
            return f"{'connection failed' if isinstance(exc, httpx.TransportError) else type(exc).__name__}: {exc}"[:300]
        if 200 <= status < 300:
            return None
        return f"HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else "")

    async def _http_post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s)
        async with self._client.stream("POST", url, content=body, headers=headers) as answer:
            return answer.status_code  # the receiver's body is never read

    async def _record(self, job_id: str, owner: str, hook: dict, state: str, error: str | None,
                      posted: bool = True) -> None:
        def write() -> None:
            if self._mine(job_id, owner) is None:
                return
            now = self.store.now()
            self.store.update_job(job_id, lease_until=now + self.lease_s, webhook={
                **hook, "state": state, "attempts": int(hook.get("attempts") or 0) + posted, "last_error": error,
                "delivered_at": now if state == DELIVERED else None})

        await asyncio.to_thread(write)

    async def _hold(self, job_id: str, owner: str, seconds: float) -> None:
        """Wait `seconds` before the next attempt, renewing the job's lease meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, self.lease_s / 3))
            if time.monotonic() < end:
                await asyncio.to_thread(self._renew, job_id, owner)

    def _renew(self, job_id: str, owner: str) -> None:
        if self._mine(job_id, owner) is not None:
            self.store.update_job(job_id, lease_until=self.store.now() + self.lease_s)


def _pending(job: JobRecord) -> bool:
    return bool(job.webhook) and job.webhook.get("state", PENDING) == PENDING and bool(job.webhook.get("url"))


def _encode(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def _minimal_payload(job: JobRecord) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(job.completed_at or 0.0, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": f"{job.kind}.{job.status}", "timestamp": stamp,
            "data": {"id": job.id, "status": job.status, "error": job.error}}
