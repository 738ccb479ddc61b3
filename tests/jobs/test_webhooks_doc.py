"""docs/HTTP_API.md's two ways to verify a webhook, run as written against what the sender signs."""

from __future__ import annotations

import re
import time
from pathlib import Path

from stepserve.jobs.webhooks import sign

DOC = Path(__file__).resolve().parents[2] / "docs" / "HTTP_API.md"
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def snippets() -> list[str]:
    section = DOC.read_text().split("### Webhooks", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def delivery(body: bytes) -> dict:
    stamp = int(time.time())
    return {"webhook-id": "msg_job", "webhook-timestamp": str(stamp),
            "webhook-signature": sign(SECRET, "msg_job", stamp, body)}


def test_the_documented_checks_accept_a_delivery_and_refuse_a_tampered_one():
    library, by_hand = snippets()
    body = b'{"type":"video.completed","data":{"id":"job"}}'
    headers = delivery(body)
    scope: dict = {"SECRET": SECRET}
    exec(library, scope)  # noqa: S102 - the documentation's own code
    assert scope["check"](headers, body) is True
    assert scope["check"](headers, body.replace(b"job", b"jab")) is False
    for data, want in ((body, True), (body + b" ", False)):
        scope = {"SECRET": SECRET, "headers": headers, "body": data}
        exec(by_hand, scope)  # noqa: S102
        assert scope["ok"] is want
