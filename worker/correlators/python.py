"""Python handlers given as ``module:function`` (or ``module:object.attribute``)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from worker.config import ConfigError


class TransactionalCorrelator:
    """A Python handler called as ``function(message, connection)`` inside the transaction that records the
    message's outcome (route ``{"type": "python", "handler": "module:function", "transactional": true}``).

    ``connection`` is a SQLAlchemy ``Connection`` on the worker's database: what the handler writes with it
    commits with the message's delivery, only while the call is still the slot's under its lease term, or not at
    all (an exception, a failure outcome, a lost term, a crash: everything is rolled back, and the message is
    delivered again). Exactly once for effects in the same database; a call out to anything else is not.
    """

    def __init__(self, function: Callable[[Any, Any], object], spec: str) -> None:
        self.function = function
        self.spec = spec

    def __call__(self, message: Any) -> object:
        raise TypeError(f"{self.spec} is transactional: the engine calls it with the recording connection")

    def __repr__(self) -> str:
        return f"transactional {self.spec}"


def load_callable(spec: str, setting: str, arguments: int = 1) -> Callable[..., object]:
    """Import ``module:function``; a missing module or attribute is a ConfigError naming the setting.
    ``arguments``: what it is called with (1: the message; 2: the message and a connection)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"invalid setting {setting}: {spec!r} is not of the form module:function")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"invalid setting {setting}: cannot import module {module_name!r}: {error}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"invalid setting {setting}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise ConfigError(f"invalid setting {setting}: {spec!r} is not callable")
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__):
        raise ConfigError(
            f"invalid setting {setting}: {spec!r} is an async function; correlators are called on worker "
            "threads and must be plain functions"
        )
    if arguments == 2 and not _takes(target, 2):
        raise ConfigError(
            f"invalid setting {setting}: {spec!r} cannot be called with two arguments (the message and the "
            "connection); a transactional correlator is a function such as def on_paid(message, connection): ..."
        )
    if arguments == 1 and not _takes(target, 1):
        raise ConfigError(
            f"invalid setting {setting}: {spec!r} cannot be called with one argument (the message); a correlator "
            "is a function such as def on_paid(message): ..."
        )
    handler: Callable[..., object] = target
    return handler


def _takes(target: Any, count: int) -> bool:
    """False when the callable surely cannot take ``count`` positional arguments (its signature, or for a
    built-in without one the first line of its documentation, ``time() -> …``); True when it can or cannot be
    told."""
    try:
        inspect.signature(target).bind(*[object()] * count)
    except TypeError:
        return False
    except ValueError:  # a built-in without a signature
        lines = (getattr(target, "__doc__", None) or "").strip().splitlines()
        name = getattr(target, "__name__", "")
        return not (name and lines and lines[0].startswith(f"{name}()"))
    return True
