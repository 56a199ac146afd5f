"""Who may use the console, and how a page login and its forms are protected.

- **Tokens.** ``CORRELATION_ADMIN__TOKEN`` may read and act, ``CORRELATION_ADMIN__READ_TOKEN`` may only read.
  The API takes ``Authorization: Bearer <token>``. Every comparison is constant-time (:func:`hmac.compare_digest`
  on digests of equal length), so a wrong guess learns nothing from the answer's timing.
- **Sessions** (the pages). The login form takes a token and sets a cookie ``cw_session`` (HttpOnly,
  SameSite=Strict, Path=/ui, Secure over https) holding ``role.expiry.nonce.mac``: a MAC over the rest keyed by
  a digest of the configured tokens. Every replica accepts the cookie of another; a session ends at its expiry
  (``CORRELATION_ADMIN__SESSION_LIFETIME``), at logout (a digest of its nonce is written to
  ``correlation_session_end`` until the expiry, so a copy of the cookie opens nothing afterwards, on any
  replica), and changing a token ends every session at once.
- **CSRF.** Every form carries a token derived from the session's nonce (an HMAC with the same key), checked in
  constant time on every POST; the login form itself uses a double-submit cookie. SameSite=Strict already keeps
  the session cookie off cross-site requests: the token is the second lock.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.config import AdminSettings

SESSION_COOKIE = "cw_session"
LOGIN_COOKIE = "cw_login"
WRITE, READ = "w", "r"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: the token's name (for the audit), through which face, and whether they may act."""

    name: str
    via: str  # 'api', 'ui' or 'cli'
    can_write: bool


@dataclass(frozen=True, slots=True)
class Session:
    """A logged-in page user."""

    caller: Caller
    nonce: str
    expires: int  # unix seconds


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of two secrets (compared as digests, so their lengths leak nothing either)."""
    return hmac.compare_digest(_digest(given), _digest(expected))


class Auth:
    """Tokens, sessions and CSRF tokens of the console."""

    def __init__(self, settings: AdminSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._clock = clock
        self._write = settings.token.get_secret_value() if settings.token is not None else None
        self._read = settings.read_token.get_secret_value() if settings.read_token is not None else None
        material = f"correlation-worker console\0{self._write or ''}\0{self._read or ''}"
        self._key = hashlib.sha256(material.encode("utf-8", "surrogatepass")).digest()

    @property
    def enabled(self) -> bool:
        """True when a token is configured (else the console is not served)."""
        return self._write is not None or self._read is not None

    def check_token(self, token: str, via: str) -> Caller | None:
        """The caller this token stands for, or None when it is no configured token."""
        write_ok = self._write is not None and _same(token, self._write)
        read_ok = self._read is not None and _same(token, self._read)
        if write_ok:
            return Caller(self.settings.token_name, via, can_write=True)
        if read_ok:
            return Caller(self.settings.read_token_name, via, can_write=False)
        return None

    def bearer(self, header: str | None) -> Caller | None:
        """The API caller of an ``Authorization`` header, or None when it is missing or wrong."""
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.check_token(token.strip(), "api")

    # -- sessions ----------------------------------------------------------------------------------------------

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def new_session(self, caller: Caller) -> str:
        """The cookie value of a new session for a logged-in caller."""
        expires = int(self._clock() + self.settings.session_lifetime.total_seconds())
        body = f"{WRITE if caller.can_write else READ}.{expires}.{secrets.token_urlsafe(18)}"
        return f"{body}.{self._mac('session:' + body)}"

    def session(self, cookie: str | None) -> Session | None:
        """The session of a cookie value, or None when it is missing, forged, or expired."""
        if not cookie or cookie.count(".") != 3:
            return None
        body, _, mac = cookie.rpartition(".")
        if not hmac.compare_digest(self._mac("session:" + body).encode(), mac.encode()):
            return None
        role, expires_text, nonce = body.split(".")
        if not expires_text.isdigit() or int(expires_text) <= self._clock():
            return None
        if role == WRITE and self._write is not None:
            caller = Caller(self.settings.token_name, "ui", can_write=True)
        elif role == READ and self._read is not None:
            caller = Caller(self.settings.read_token_name, "ui", can_write=False)
        else:
            return None
        return Session(caller, nonce, int(expires_text))

    @staticmethod
    def ended_key(session: Session) -> str:
        """What a logout records of a session: a digest of its nonce (never the cookie itself)."""
        return hashlib.sha256(("session-end:" + session.nonce).encode()).hexdigest()

    def csrf_token(self, session: Session) -> str:
        """The CSRF token of every form of this session."""
        return self._mac("csrf:" + session.nonce)

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        """True when a form's CSRF token belongs to this session (constant time)."""
        return token is not None and hmac.compare_digest(self.csrf_token(session).encode(), token.encode())

    @staticmethod
    def login_nonce() -> str:
        """A fresh value for the login form's double-submit cookie."""
        return secrets.token_urlsafe(18)

    @staticmethod
    def login_nonce_ok(cookie: str | None, form: str | None) -> bool:
        """True when the login form's CSRF field matches its cookie (constant time)."""
        return bool(cookie) and form is not None and _same(form, cookie or "")
