"""correlation-worker: a clustered, database-backed message correlation worker.

Handlers import their outcomes and the message type from here::

    from worker import Message, Retry, PermanentError, Reschedule, Result
"""

from worker.message import Message, MessageState
from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry

__all__ = ["AuthProblem", "Message", "MessageState", "PermanentError", "Reschedule", "Result", "Retry"]
__version__ = "0.1.0"
