"""Showing a URL that may carry a secret (`--state redis://:PASSWORD@HOST/0`): the one redaction every banner, error,
log line and setting that travels uses."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_QUERY = ("password",)  # query parameters that carry a secret (redis-py reads `password=`)


def without_password(url: str) -> str:
    """The URL with any password left out (in the user part or a `password=` query parameter); the rest as given."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL at all: show nothing after an "@" (it may be a user:password)
        return url.rpartition("@")[2]
    if "@" in url and "@" not in parts.netloc:  # malformed (redis:/:pw@host): what precedes the "@" may be secret
        return f"{parts.scheme + '://' if parts.scheme else ''}***@{url.rpartition('@')[2]}"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = [(k, v) for k, v in pairs if k.lower() not in SECRET_QUERY]
    if ":" not in userinfo and len(query) == len(pairs):
        return url  # nothing secret: as given (sqlite:///PATH stays so, which urlunsplit would not keep)
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}@{hostport}" if at and user else hostport
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query) if query else "", parts.fragment))


def has_password(url: str) -> bool:
    return without_password(url) != url
