"""Credentials out of everything the worker prints: URLs, correlator routes and free text.

One module, used by every printer (``check-config``, ``migrate``, ``run``'s startup line, the logs, error
messages), so that a secret hidden in one place is hidden everywhere. What counts as a secret:

- the password of a URL's userinfo (``postgresql://shop:s3cret@db/shop`` → ``shop:***@``), and for http(s)
  URLs any userinfo at all (``https://TOKEN@host`` is a token, not a user name);
- the value of a query parameter named like a credential (``?password=…``, ``?token=…``, ``?api_key=…``,
  ``?sig=…``);
- the value of an http route header named like a credential (``Authorization``, ``X-Api-Key``, ``Cookie``,
  ``X-Auth-Token``, …): the name stays, the value becomes ``***``;
- ``password=…`` pairs in free text (libpq connection strings in driver messages).

Pure functions, no imports from the rest of the package: every layer may use them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

MASK = "***"

# A parameter or header whose (lower-case) name contains one of these carries a credential.
_SENSITIVE_PARTS = (
    "pass", "pwd", "token", "secret", "key", "auth", "credential", "signature", "session", "cookie", "private",
)
# ... or whose whole name is one of these (too short to match as a part).
_SENSITIVE_NAMES = frozenset({"sig", "pw", "jwt", "sas"})

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_PASSWORD_PAIR = re.compile(r"\b(password|passwd|pwd)(\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s&;,]+)", re.IGNORECASE)


def is_sensitive(name: str) -> bool:
    """True when a query parameter or header of this name carries a credential."""
    lowered = name.strip().lower()
    return lowered in _SENSITIVE_NAMES or any(part in lowered for part in _SENSITIVE_PARTS)


def _redact_query(query: str) -> str:
    parts = []
    for part in query.split("&"):
        name, equals, _value = part.partition("=")
        parts.append(f"{name}={MASK}" if equals and is_sensitive(name) else part)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """The URL with every credential replaced by ``***`` (userinfo password, credential query parameters)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. unbalanced IPv6 brackets: fall back to the text rules
        return _PASSWORD_PAIR.sub(rf"\1\2{MASK}", _userinfo_by_pattern(url))
    shown = url
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        if colon:
            userinfo = f"{user}:{MASK}"
        elif parts.scheme.lower() in ("http", "https"):
            userinfo = MASK
        shown = shown.replace(f"//{parts.netloc}", f"//{userinfo}@{host}", 1)
    if parts.query:  # rebuilt by hand, not by urlunsplit, so that the rest of the URL stays exactly as given
        shown = shown.replace(f"?{parts.query}", f"?{_redact_query(parts.query)}", 1)
    return shown


def _userinfo_by_pattern(url: str) -> str:
    return re.sub(r"(://[^:/@\s]*):[^@/\s]*@", rf"\1:{MASK}@", url)


def redact_text(text: str) -> str:
    """Free text (an error, a log line) with every URL in it redacted and ``password=…`` pairs masked."""
    if "://" in text:
        text = _URL.sub(lambda match: redact_url(match.group(0)), text)
    if "=" in text:
        text = _PASSWORD_PAIR.sub(rf"\1\2{MASK}", text)
    return text


def redact_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header names with their values, the values of credential headers replaced by ``***``."""
    return {str(name): MASK if is_sensitive(str(name)) else str(value) for name, value in headers.items()}


def redact_route(spec: str | Mapping[str, Any]) -> str:
    """A correlator route as one line of text, with its URL and credential headers redacted.

    ``"log"`` and ``"module:function"`` routes are shown as given; an object route as ``key=value`` pairs
    (``type=http, url=https://user:***@engine/…, headers={"Authorization": "***"}``).
    """
    if isinstance(spec, str):
        return redact_text(spec)
    shown = []
    for key, value in spec.items():
        if key == "headers" and isinstance(value, Mapping):
            rendered = json.dumps(redact_headers(value), ensure_ascii=False)
        elif isinstance(value, str):
            rendered = redact_url(value) if "://" in value else value
        else:
            rendered = redact_text(json.dumps(value, ensure_ascii=False, default=str))
        if is_sensitive(str(key)) and key != "headers":
            rendered = MASK
        shown.append(f"{key}={rendered}")
    return ", ".join(shown)
