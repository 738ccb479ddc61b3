"""An edit's ControlNets as multipart form parts (`POST /v1/images/edits`, docs/CONTROLNET.md):

    controls[0][name]=pose   controls[0][image]=<file>   controls[0][scale]=0.8   controls[0][start]=0
    controls[0][end]=0.6     controls[0][preprocess]=canny   controls[0][guess_mode]=true
    controls[1][name]=depth   controls[1][image]=<file> ...

Each control is numbered from 0 without gaps (at most MAX_PER_REQUEST); its `name` and its `image` (a file: PNG,
JPEG or WebP, with an edit image's limits, checked before decoding by edits.py) are required, the rest optional
and read as a generation's control reads them (scale, start and end as numbers, guess_mode as true or false). A part that does not fit the
scheme, or a `controls` field (a generation's JSON list), is a 400 naming it and saying what is allowed.
"""

from __future__ import annotations

import re

from starlette.datastructures import FormData, UploadFile

from ..controls.spec import KEYS, MAX_PER_REQUEST
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
        item = found.setdefault(i, {})
        if part in item:
            raise invalid(f"{key}: given more than once; send each part once", key)
        if (part == "image") != isinstance(value, UploadFile):
            raise invalid(f"{key}: an image file (PNG, JPEG or WebP) is expected" if part == "image" else
                          f"{key}: a file where a form field is expected; files taken: controls[i][image]", key)
        if part == "image" or part in _TEXT:
            item[part] = value
        else:
            try:
                item[part] = json_value(value)
            except ValueError:
                raise invalid(f"{key}: {value[:40]!r} is not a number" + (" (allowed: true or false)" if part ==
                              "guess_mode" else ""), key) from None
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
