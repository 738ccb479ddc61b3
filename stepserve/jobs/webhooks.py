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

Delivery: a 2xx is success. Anything else (redirects are not followed), a timeout, a connection error or a host
that now resolves where webhooks may not go (targets.py) is retried after the next of `delays_s`; when they are
used up the delivery is failed (the job stays completed). Every attempt resolves the host again, checks every
address and connects only to those (aiohttp with a resolver that returns them: the URL's Host and TLS name are
kept), so a name rebound to an internal address after the job was made is never connected to. The job's webhook
state, as GET shows it: {"url", "state": "pending" | "delivered" | "failed", "attempts", "last_status" (the HTTP
status of the last answer, or null), "last_error" (a short fixed phrase: "HTTP 503", "no answer", "refused"),
"delivered_at"}. What a failed connection said (which could tell a client about the inside) goes to the log only.

The outbox: a job made with a webhook parks its delivery in the store (`park`: no body yet, claimable only once
the job has ended). When the job ends, the process that ended it stores the exact body every attempt sends
(store.create_delivery fills the parked record) and holds it under a lease that it renews while it posts and while
it waits to retry. A process that dies leaves it there; `resume` (every lease, by every process) claims deliveries
whose lease has passed and whose job has ended, one atomic claim each, and sends the same body under the same
webhook-id; a parked one whose job ended without a body (its process died in between) gets the payload the job's
end would have sent (`payload_of`). So two processes never deliver one event at once (a sender that loses its lease
stops before its next write), and a delivery is never lost to a scan's window. A delivery leaves the outbox when
it is delivered, failed, or its job is deleted.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..store.base import DeliveryRecord, JobRecord, Store
from .notify import payloads
from .targets import WebhookTargetError, WebhookTargets

log = logging.getLogger("stepserve.jobs")
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
SECRET_PREFIX = "whsec_"
RESUME_BATCH = 100  # deliveries one process takes up per round (the rest wait for the next round)
NO_ANSWER, REFUSED = "no answer", "refused: the host resolves to an address webhooks are not sent to"

# (url, the checked addresses to connect to, body, headers, timeout_s) -> the answer's HTTP status
Post = Callable[[str, list[str], bytes, dict[str, str], float], Awaitable[int]]


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
                 post: Post | None = None, lease_s: float = 30.0, targets: WebhookTargets | None = None,
                 payload_of: Callable[[JobRecord], Awaitable[dict]] | None = None,
                 service: str | None = None) -> None:
        """`post`: send one attempt (default: post_pinned); `lease_s`: how long a dead sender's deliveries wait
        before `resume` takes them; `targets`: where webhooks may go (default: public addresses only);
        `payload_of`: the payload of a parked delivery whose job ended without one (notify.payloads; default: the
        job's id, status and error); `service`: `resume` takes up only that service's deliveries (another
        service's server signs with another secret; None: any, for a store of one service)."""
        if secret is not None:
            secret_key(secret)  # a malformed secret fails at start, not at the first delivery
        self.store, self.secret, self.delays_s, self.timeout_s = store, secret, tuple(delays_s), timeout_s
        self.lease_s, self.service = lease_s, service
        self.targets = targets or WebhookTargets()
        self.payload_of = payload_of or payloads({})
        self._post = post
        self._tasks: set[asyncio.Task] = set()

    async def deliver(self, job: JobRecord, payload: dict, owner: str) -> None:
        """Put the job's delivery in the outbox (held by `owner`) and POST json(payload) to job.webhook["url"]
        until a 2xx, or until the retries end (see the module). Nothing when the job has a delivery already."""
        now = await asyncio.to_thread(self.store.now)
        record = DeliveryRecord(job.id, job.webhook["url"], _encode(payload).decode(), now, owner, now + self.lease_s,
                                service=job.service)
        if await asyncio.to_thread(self.store.create_delivery, record):
            await self._attempts(record, owner)

    async def resume(self, owner: str) -> None:
        """Deliveries left by a process that died (their lease has passed): claim each, holding its lease while
        trying, and deliver it with the body it was stored with. A store that fails ends the round (logged): what
        is left waits in the outbox for the next."""
        tasks = []
        try:
            while len(tasks) < RESUME_BATCH:
                record = await asyncio.to_thread(self.store.claim_delivery, owner, self.lease_s, None, self.service)
                if record is None:
                    break
                log.info("job %s: taking up its webhook delivery left by %s", record.job_id, record.owner)
                tasks.append(asyncio.ensure_future(self._attempts(record, owner)))
        except Exception:  # noqa: BLE001 - the state store unreachable: the next round tries again
            log.warning("webhooks: the outbox could not be read", exc_info=True)
        self._tasks.update(tasks)
        try:
            for task, outcome in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True)):
                if isinstance(outcome, Exception):
                    log.warning("webhooks: a delivery stopped (it stays in the outbox for a later round)",
                                exc_info=outcome)
        finally:
            self._tasks.difference_update(tasks)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- one delivery ----------------------------------------------------------------------------------------
    async def _attempts(self, record: DeliveryRecord, owner: str) -> None:
        job_id, attempts, body = record.job_id, record.attempts, record.body.encode()
        if not body:  # parked: the process that ended the job died before storing the body
            job = await asyncio.to_thread(self.store.get_job, job_id)
            if job is not None and _pending(job):
                body = _encode(await self.payload_of(job))
                if await asyncio.to_thread(self.store.renew_delivery, job_id, owner, self.lease_s, None,
                                           body.decode()) is None:
                    return
        while True:
            job = await asyncio.to_thread(self.store.get_job, job_id)
            if job is None or not _pending(job):  # deleted, or its end recorded already: nothing more to send
                await asyncio.to_thread(self.store.end_delivery, job_id, owner)
                return
            if not self.secret:
                await self._record(job, FAILED, attempts, None, "no webhook secret: nothing is sent unsigned")
                await asyncio.to_thread(self.store.end_delivery, job_id, owner)
                return
            sent = await self._holding(job_id, owner, self._send(record.url, f"msg_{job_id}", body))
            if sent is None:
                return  # taken over meanwhile: the new owner sends, and records
            status, error = sent
            attempts += 1
            state = DELIVERED if error is None else FAILED if attempts > len(self.delays_s) else PENDING
            if await asyncio.to_thread(self.store.renew_delivery, job_id, owner, self.lease_s, attempts) is None:
                return
            await self._record(job, state, attempts, status, error)
            if state != PENDING:
                if state == FAILED:
                    log.warning("job %s: webhook not delivered after %d attempts (last: %s)", job_id, attempts, error)
                await asyncio.to_thread(self.store.end_delivery, job_id, owner)
                return
            if await self._holding(job_id, owner, asyncio.sleep(self.delays_s[attempts - 1], True)) is None:
                return

    async def _holding(self, job_id: str, owner: str, work: Awaitable):
        """`work`'s result, the delivery's lease renewed every lease_s / 3 meanwhile; None (work cancelled) once
        the delivery is no longer this owner's."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=self.lease_s / 3))[0]:
                if await asyncio.to_thread(self.store.renew_delivery, job_id, owner, self.lease_s) is None:
                    log.warning("job %s: its webhook delivery was taken over by another process; stopped here", job_id)
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _send(self, url: str, msg_id: str, body: bytes) -> tuple[int | None, str | None]:
        """One attempt: (the HTTP status or None, None on a 2xx else what the client is told)."""
        try:
            addresses = await asyncio.to_thread(self.targets.addresses, url)
        except WebhookTargetError as exc:
            log.warning("webhook %s not sent: %s", msg_id, exc.detail)
            return None, REFUSED
        stamp = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "stepserve-webhooks", "webhook-id": msg_id,
                   "webhook-timestamp": str(stamp), "webhook-signature": sign(self.secret, msg_id, stamp, body)}
        try:
            status = await (self._post or post_pinned)(url, addresses, body, headers, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - every failure to get an answer is retried; its text is logged only
            log.info("webhook %s: no answer from %s: %s", msg_id, ", ".join(addresses), str(exc) or type(exc).__name__)
            return None, NO_ANSWER
        if 200 <= status < 300:
            return status, None
        return status, f"HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else "")

    async def _record(self, job: JobRecord, state: str, attempts: int, status: int | None, error: str | None) -> None:
        def write() -> None:
            now = self.store.now()
            self.store.update_job(job.id, webhook={
                **job.webhook, "state": state, "attempts": attempts, "last_status": status, "last_error": error,
                "delivered_at": now if state == DELIVERED else None})

        await asyncio.to_thread(write)


async def post_pinned(url: str, addresses: list[str], body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST to `url` connecting only to `addresses` (checked by the caller): the Host header and the TLS server name
    stay the URL's. No redirect is followed, no proxy from the environment is used, the answer's body is not read."""
    import aiohttp
    from aiohttp.abc import AbstractResolver

    class Pinned(AbstractResolver):
        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
            return [{"hostname": host, "host": a, "port": port, "proto": 0, "flags": socket.AI_NUMERICHOST,
                     "family": socket.AF_INET6 if ":" in a else socket.AF_INET} for a in addresses]

        async def close(self) -> None:
            pass

    connector = aiohttp.TCPConnector(resolver=Pinned(), use_dns_cache=False, force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, data=body, headers=headers, allow_redirects=False) as answer:
            return answer.status


def park(store: Store, job: JobRecord) -> None:
    """At a job's creation (blocking): its delivery, parked until the job ends (see the module). A store that
    fails here is logged and the job goes on: its end stores the delivery all the same."""
    if job.webhook and job.webhook.get("url"):
        try:
            store.create_delivery(DeliveryRecord(job.id, job.webhook["url"], "", store.now(), service=job.service))
        except Exception:  # noqa: BLE001
            log.warning("job %s: its webhook delivery could not be parked in the outbox", job.id, exc_info=True)


def _pending(job: JobRecord) -> bool:
    return bool(job.webhook) and job.webhook.get("state", PENDING) == PENDING and bool(job.webhook.get("url"))


def _encode(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
