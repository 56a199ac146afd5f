"""correlation-worker: a clustered, database-backed message correlation worker.

Handlers import their outcomes and the message type from here::

    from worker import Message, Retry, PermanentError, Reschedule, Result

Each of those names is imported when first asked for: importing a module of the package (the command's,
:mod:`worker.cli`) does not import SQLAlchemy and pydantic before that module decides how they are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.message import Message, MessageState
    from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry

__all__ = ["AuthProblem", "Message", "MessageState", "PermanentError", "Reschedule", "Result", "Retry"]
__version__ = "0.2.0"

_HOMES = {
    "Message": "worker.message",
    "MessageState": "worker.message",
    **dict.fromkeys(("AuthProblem", "PermanentError", "Reschedule", "Result", "Retry"), "worker.policy.outcomes"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
