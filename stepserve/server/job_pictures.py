"""The pictures a generation's JSON body carries in base64 (its ControlNets' `controls[i].image`, its image prompts'
`ip_adapter.image` or `ip_adapter[i].image`), taken out of an async job's stored body into input files, as an
edit's uploaded pictures are: a job document stays small (the store reads and copies documents, and megabytes in
each made every read of the job cost megabytes), and a rerun on any process puts them back.

Each picture becomes the input role `controls-I` or `ip_adapter` / `ip_adapter-I` (its file: JOB.ROLE in the
results folder); the body keeps the item with an empty `image`. The request was checked before (a 400 makes no
job), so the base64 here is known to decode."""

from __future__ import annotations

import base64
import copy
from typing import Any

from .pictures import from_base64


def _items(body: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(role, the item holding the picture, its field) for each base64 picture of the body."""
    found = [(f"controls-{i}", item, f"controls[{i}].image") for i, item in enumerate(body.get("controls") or [])]
    prompt = body.get("ip_adapter")
    if isinstance(prompt, list):
        found += [(f"ip_adapter-{i}", item, f"ip_adapter[{i}].image") for i, item in enumerate(prompt)]
    elif prompt is not None:
        found.append(("ip_adapter", prompt, "ip_adapter.image"))
    return [(role, item, field) for role, item, field in found
            if isinstance(item, dict) and isinstance(item.get("image"), str) and item["image"]]


def take_pictures(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the body without its pictures, role -> the picture's bytes)."""
    body = copy.deepcopy(body)
    pictures = {}
    for role, item, field in _items(body):
        pictures[role] = from_base64(item["image"], field)
        item["image"] = ""
    return body, pictures


def put_pictures(body: dict[str, Any], pictures: dict[str, bytes]) -> dict[str, Any]:
    """The body with the pictures of its roles back in, in base64 (as the client sent them)."""
    body = copy.deepcopy(body)
    slots = {"ip_adapter": body.get("ip_adapter")} if isinstance(body.get("ip_adapter"), dict) else {}
    slots.update({f"controls-{i}": item for i, item in enumerate(body.get("controls") or [])})
    if isinstance(body.get("ip_adapter"), list):
        slots.update({f"ip_adapter-{i}": item for i, item in enumerate(body["ip_adapter"])})
    for role, data in pictures.items():
        if role in slots and isinstance(slots[role], dict):
            slots[role]["image"] = base64.b64encode(data).decode()
    return body
