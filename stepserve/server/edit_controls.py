"""An edit's ControlNets and image prompt as multipart form parts (`POST /v1/images/edits`, docs/CONTROLNET.md):

    controls[0][name]=pose   controls[0][image]=<file>   controls[0][scale]=0.8   controls[0][start]=0
    controls[0][end]=0.6     controls[0][preprocess]=canny   controls[0][guess_mode]=true
    controls[1][name]=depth   controls[1][image]=<file> ...

Each control is numbered from 0 without gaps (at most MAX_PER_REQUEST); its `name` and its `image` (a file: PNG,
JPEG or WebP, with an edit image's limits, checked before decoding by edits.py) are required, the rest optional
and read as a generation's control reads them (scale, start and end as numbers, guess_mode as true or false). A part that does not fit the
scheme, or a `controls` field (a generation's JSON list), is a 400 naming it and saying what is allowed.

An image prompt (IP-Adapter) the same way, one per request:

    ip_adapter[name]=face   ip_adapter[image]=<file>   ip_adapter[scale]=0.6

`name` and `image` required, `scale` optional (a number); a part outside the scheme, or an `ip_adapter` field (a
generation's JSON object), is a 400 naming it.
"""

from __future__ import annotations

import re

from starlette.datastructures import FormData, UploadFile

from ..controls.spec import KEYS, MAX_PER_REQUEST
from ..ipadapter import spec as image_prompt
from .bodies import json_value
from .errors import invalid

PART = re.compile(r"controls\[(\d{1,3})\]\[([A-Za-z_]*)\]\Z")
_TEXT = ("name", "preprocess")  # taken as text; scale, start, end and guess_mode as JSON values
SCHEME = ("controls[i][name] and controls[i][image] (a file), optionally controls[i][scale], controls[i][start], "
          f"controls[i][end], controls[i][preprocess] and controls[i][guess_mode], i from 0 to {MAX_PER_REQUEST - 1}")


def control_parts(form: FormData) -> tuple[list[dict], list[UploadFile], set[str]]:
    """(each control's fields without its image, in order; their image files, in the same order; the form keys
    they took)."""
    found: dict[int, dict] = {}
    taken: set[str] = set()
    for key, value in form.multi_items():
        if key == "controls":
            raise invalid(f"controls: an edit takes its controls as form parts, not a JSON list; send {SCHEME}",
                          "controls")
        if not key.startswith("controls"):
            continue
        match = PART.match(key)
        if match is None or match[2] not in KEYS:
            raise invalid(f"{key[:60]}: not a control's part; allowed: {SCHEME}", key[:60])
        i, part = int(match[1]), match[2]
        if i >= MAX_PER_REQUEST:
            raise invalid(f"{key}: at most {MAX_PER_REQUEST} controls per request (numbered from 0)", key)
        _take(found.setdefault(i, {}), key, part, value, "controls[i][image]")
        taken.add(key)
    for i in range(len(found)):
        if i not in found:
            raise invalid(f"controls[{i}]: missing; number the controls from 0 without gaps ({SCHEME})",
                          f"controls[{i}]")
        for part in ("name", "image"):
            if part not in found[i]:
                raise invalid(f"controls[{i}][{part}]: required with controls[{i}]; send {SCHEME}",
                              f"controls[{i}][{part}]")
    controls = [found[i] for i in range(len(found))]
    return [{k: v for k, v in c.items() if k != "image"} for c in controls], [c["image"] for c in controls], taken


IP_PART = re.compile(r"ip_adapter\[([A-Za-z_]*)\]\Z")
IP_SCHEME = "ip_adapter[name] and ip_adapter[image] (a file), optionally ip_adapter[scale]"


def image_prompt_parts(form: FormData) -> tuple[dict | None, UploadFile | None, set[str]]:
    """(the image prompt's fields without its image, or None when the form has none; its image file; the form
    keys it took)."""
    found: dict = {}
    taken: set[str] = set()
    for key, value in form.multi_items():
        if key == "ip_adapter":
            raise invalid(f"ip_adapter: an edit takes its image prompt as form parts, not a JSON object; send "
                          f"{IP_SCHEME}", "ip_adapter")
        if not key.startswith("ip_adapter"):
            continue
        match = IP_PART.match(key)
        if match is None or match[1] not in image_prompt.KEYS:
            raise invalid(f"{key[:60]}: not an image prompt's part; allowed: {IP_SCHEME}", key[:60])
        _take(found, key, match[1], value, "ip_adapter[image]")
        taken.add(key)
    if not found:
        return None, None, taken
    for part in ("name", "image"):
        if part not in found:
            raise invalid(f"ip_adapter[{part}]: required with an image prompt; send {IP_SCHEME}",
                          f"ip_adapter[{part}]")
    return {k: v for k, v in found.items() if k != "image"}, found["image"], taken


def _take(item: dict, key: str, part: str, value, files: str) -> None:
    """One form part into `item`: the image a file, name and preprocess as text, the rest as JSON values (a number,
    or true or false). `files`: the file parts the scheme takes (for the message)."""
    if part in item:
        raise invalid(f"{key}: given more than once; send each part once", key)
    if (part == "image") != isinstance(value, UploadFile):
        raise invalid(f"{key}: an image file (PNG, JPEG or WebP) is expected" if part == "image" else
                      f"{key}: a file where a form field is expected; files taken: {files}", key)
    if part == "image" or part in _TEXT:
        item[part] = value
        return
    try:
        item[part] = json_value(value)
    except ValueError:
        raise invalid(f"{key}: {value[:40]!r} is not a number" + (" (allowed: true or false)" if part ==
                      "guess_mode" else ""), key) from None
