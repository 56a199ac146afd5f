"""correlation-worker: a clustered, database-backed message correlation worker.

Handlers import their outcomes and the message type from here::

    from worker import Message, Retry, PermanentError, Reschedule
"""

from worker.message import Message, MessageState
from worker.policy.outcomes import PermanentError, Reschedule, Retry

__all__ = ["Message", "MessageState", "PermanentError", "Reschedule", "Retry"]
__version__ = "0.1.0"
