"""Python handlers given as ``module:function`` (or ``module:object.attribute``)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from worker.config import ConfigError


def load_callable(spec: str, setting: str) -> Callable[[Any], object]:
    """Import ``module:function``; a missing module or attribute is a ConfigError naming the setting."""
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
    if not _takes_one_argument(target):
        raise ConfigError(
            f"invalid setting {setting}: {spec!r} cannot be called with one argument (the message); a correlator "
            "is a function such as def on_paid(message): ..."
        )
    handler: Callable[[Any], object] = target
    return handler


def _takes_one_argument(target: Any) -> bool:
    """False when the callable surely cannot take one positional argument (its signature, or for a built-in
    without one the first line of its documentation, ``time() -> …``); True when it can or cannot be told."""
    try:
        inspect.signature(target).bind(object())
    except TypeError:
        return False
    except ValueError:  # a built-in without a signature
        lines = (getattr(target, "__doc__", None) or "").strip().splitlines()
        name = getattr(target, "__name__", "")
        return not (name and lines and lines[0].startswith(f"{name}()"))
    return True
