"""Correlators: where a message goes. Routed by ``message_name``, with ``*`` as the fallback.

A correlator is any callable taking a :class:`~worker.message.Message`. Returning means success; raising
means retry, except :class:`~worker.policy.outcomes.PermanentError` (dead) and
:class:`~worker.policy.outcomes.Reschedule` (not yet). Routes come from ``CORRELATION_CORRELATORS``::

    {"order.paid": "shop.handlers:on_paid", "*": "log"}
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from worker.config import ConfigError
from worker.correlators.log import LogCorrelator
from worker.correlators.network import TARGET_KEYS
from worker.correlators.python import TransactionalCorrelator, load_callable
from worker.message import Message
from worker.policy.routing import FALLBACK
from worker.redact import redact_route

Correlator = Callable[[Message], object]


class Router:
    """Finds the correlator of a message name; built once at startup so that bad routes fail early."""

    def __init__(self, routes: Mapping[str, Correlator], descriptions: Mapping[str, str] | None = None) -> None:
        self._routes = dict(routes)
        self._descriptions = dict(descriptions or {name: repr(c) for name, c in routes.items()})

    @classmethod
    def from_settings(cls, specs: Mapping[str, str | Mapping[str, Any]]) -> Router:
        """Build every route now; an unknown kind or an unimportable handler is a ConfigError."""
        destinations: dict[str, Any] = {}  # routes naming the same destination share its state
        routes = {name: _build(name, spec, destinations) for name, spec in specs.items()}
        descriptions = {}
        for name, spec in specs.items():
            # A correlator configured elsewhere too (camunda8: the SDK's variables) says where it goes.
            where = getattr(routes[name], "describe", None)
            descriptions[name] = redact_route(spec) + (f" -> {where()}" if callable(where) else "")
        return cls(routes, descriptions)

    def route(self, message_name: str) -> Correlator | None:
        """The correlator for this name, the fallback, or None when neither is configured."""
        return self._routes.get(message_name) or self._routes.get(FALLBACK)

    def describe(self) -> dict[str, str]:
        """The routes as text, for check-config and logs, with every credential hidden."""
        return dict(self._descriptions)

    def destinations(self) -> list[Any]:
        """The network destinations the routes send to, each once
        (:class:`~worker.correlators.network.Destination`)."""
        found: dict[int, Any] = {}
        for correlator in self._routes.values():
            destination = getattr(correlator, "destination", None)
            if destination is not None:
                found.setdefault(id(destination), destination)
        return list(found.values())

    def transactional(self) -> bool:
        """Whether a route calls its handler inside the recording transaction (it holds a connection a call)."""
        from worker.correlators.python import TransactionalCorrelator

        return any(isinstance(correlator, TransactionalCorrelator) for correlator in self._routes.values())

    def close(self) -> None:
        """Close the routes' connections."""
        for correlator in self._routes.values():
            close = getattr(correlator, "close", None)
            if callable(close):
                close()


# The keys each kind of route takes: any other (a misspelling such as "tiemout") is refused, not ignored.
# Network routes also take their destination's settings.
_TARGET_KEYS = TARGET_KEYS
ROUTE_KEYS = {
    "log": frozenset({"type"}),
    "python": frozenset({"type", "handler", "target", "transactional"}),
    "http": frozenset({"type", "url", "preset", "timeout", "headers", "auth", "all", "without_tenant_id"})
    | _TARGET_KEYS,
    "camunda8": frozenset({"type", "mode", "url", "tenant_id", "time_to_live", "timeout"}) | _TARGET_KEYS,
}


def _python(spec: Mapping[str, Any], setting: str) -> Correlator:
    """A python route: ``handler`` (or ``target``) names the function; ``transactional`` calls it with the
    connection of the transaction that records the outcome."""
    if "handler" in spec and "target" in spec:
        raise ConfigError(f"invalid setting {setting}: give the function as 'handler' or as 'target', not both")
    if not spec.get("handler", spec.get("target")):
        raise ConfigError(
            f"invalid setting {setting}: a python route needs 'handler' (or 'target'), the function as "
            '"module:function": {"type": "python", "handler": "shop.handlers:on_paid"}'
        )
    function = str(spec.get("handler", spec.get("target", "")))
    transactional = spec.get("transactional", False)
    if not isinstance(transactional, bool):
        raise ConfigError(f"invalid setting {setting}: 'transactional' is true or false, not {transactional!r}")
    if not transactional:
        return load_callable(function, setting)
    return TransactionalCorrelator(load_callable(function, setting, arguments=2), function)


def _build(name: str, spec: str | Mapping[str, Any], destinations: dict[str, Any]) -> Correlator:
    setting = f"CORRELATION_CORRELATORS[{name}]"
    if isinstance(spec, str):
        if spec == "log":
            return LogCorrelator()
        if ":" in spec:
            return load_callable(spec, setting)
        raise ConfigError(f"invalid setting {setting}: {spec!r} is neither 'log' nor 'module:function'")
    kind = spec.get("type")
    if kind is None:
        misspelt = next((key for key in spec if difflib.get_close_matches(str(key), ["type"], n=1)), None)
        hint = f" ({misspelt!r}: did you mean 'type'?)" if misspelt is not None else ""
        raise ConfigError(
            f"invalid setting {setting}: a route object needs 'type', one of {', '.join(ROUTE_KEYS)}{hint} "
            '(e.g. {"type": "http", "url": ...})'
        )
    known = ROUTE_KEYS.get(kind) if isinstance(kind, str) else None
    for key in spec:
        if known is not None and key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            keys = ", ".join(sorted(known))
            hint = f" (did you mean {near[0]!r}?)" if near else f"; the keys of a {kind} route: {keys}"
            raise ConfigError(f"invalid setting {setting}: {key!r} is not a key of a {kind} route{hint}")
    if kind == "log":
        return LogCorrelator()
    if kind == "python":
        return _python(spec, setting)
    # The network layer (libcurl, the call loop) is imported by the routes that use it.
    if kind == "http":
        from worker.correlators.http import HttpCorrelator

        return HttpCorrelator.from_spec(spec, setting, destinations)
    if kind == "camunda8":
        from worker.correlators.camunda8 import Camunda8Correlator

        return Camunda8Correlator.from_spec(spec, setting, destinations)
    raise ConfigError(
        f"invalid setting {setting}: unknown correlator type {kind!r}; use 'log', 'module:function', "
        '{"type": "http", "url": ...} or {"type": "camunda8", "mode": "correlate"}'
    )
