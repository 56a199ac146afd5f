"""The console's routes on the endpoint: the JSON API under ``/api/v1`` and the pages under ``/ui``.

The two faces take the :class:`~worker.admin.console.Console` they serve; this module, above both, mounts them.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Mount

from worker.admin.api import api_application
from worker.admin.console import Console
from worker.admin.pages import pages_application


def console_routes(console: Console) -> list[BaseRoute]:
    """``/api/v1`` and ``/ui`` of this console, to mount on the endpoint."""
    return [Mount("/api/v1", app=api_application(console)), Mount("/ui", app=pages_application(console))]
