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
    handler: Callable[[Any], object] = target
    return handler
