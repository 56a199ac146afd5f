"""The console's JSON API under ``/api/v1`` (docs/guides/console.md lists every route with a curl example).

Every route needs ``Authorization: Bearer <token>``: a missing or wrong token is 401, the read-only token on
a route that changes something is 403. Errors are ``{"error": "one sentence"}`` with 400 (a bad filter or
body), 404, 409 (a pause that is already there) or 503 (the database did not answer in time). Pages of
messages are keyset pages, ``{"items": [...], "next": cursor}``: pass ``next`` as ``after``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from worker.admin import audit, messages, overview, pauses, schedule_actions, schedules
from worker.admin.auth import Caller
from worker.admin.console import Console
from worker.admin.errors import AdminError, BadRequest, Forbidden, MethodNotAllowed, NotFound, refuse_nul
from worker.db.console import BULK_ACTIONS
from worker.db.store import DatabaseBusy, DatabaseUnavailable, StoreError
from worker.echo import bounded_line

BODY_MAX = 1_048_576  # bytes of a request body
SECURITY_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}

Handler = Callable[[Request, Caller], Awaitable[Any]]
Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": message}`` with the status."""
    return JSONResponse(
        {"error": bounded_line(message)}, status_code=status, headers={**SECURITY_HEADERS, **(headers or {})}
    )


def store_error(error: Exception) -> JSONResponse:
    """A database that did not answer in time, or at all, as a 503 saying what to do."""
    if isinstance(error, DatabaseBusy):
        return error_response(
            503,
            f"the database gave up the request ({error}); a statement timeout is "
            "CORRELATION_ADMIN__STATEMENT_TIMEOUT: narrow the filter or try again",
        )
    if isinstance(error, DatabaseUnavailable):
        return error_response(503, f"the database is not reachable: {error}")
    return error_response(503, f"the database could not answer: {error}")


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (an empty body is ``{}``)."""
    body = await request.body()
    if len(body) > BODY_MAX:
        raise BadRequest(f"the body has {len(body)} bytes; at most {BODY_MAX}")
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError as error:
        raise BadRequest(f"the body is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise BadRequest('the body must be a JSON object such as {"state": "dead"}')
    return data


def api_application(console: Console) -> Starlette:
    """The API's routes on the console."""
    store = console.store
    auth = console.auth

    def guarded(handler: Handler, *, write: bool = False, created: bool = False) -> Endpoint:
        """The handler behind the bearer check (and the write check), its errors as JSON."""
        async def endpoint(request: Request) -> Response:
            caller = auth.bearer(request.headers.get("authorization"))
            if caller is None:
                return error_response(
                    401,
                    "missing or wrong token: send Authorization: Bearer <token> (CORRELATION_ADMIN__TOKEN, or "
                    "__READ_TOKEN to read)",
                    {"WWW-Authenticate": 'Bearer realm="correlation-worker"'},
                )
            if write and not caller.can_write:
                return error_response(
                    403, f"the token {caller.name!r} may only read; this route needs CORRELATION_ADMIN__TOKEN"
                )
            try:
                refuse_nul(request.url.path, *(f"{k}={v}" for k, v in request.query_params.multi_items()))
                try:
                    data = await handler(request, caller)
                except DatabaseUnavailable:
                    if request.method != "GET":
                        raise
                    data = await handler(request, caller)  # once more on a fresh connection (see the pages)
            except AdminError as error:
                allow = {"Allow": ", ".join(error.allow)} if isinstance(error, MethodNotAllowed) else None
                return error_response(error.status, str(error), allow)
            except StoreError as error:  # any trouble of the database: a 503 naming it, never a bare 500
                return store_error(error)
            return JSONResponse(data, status_code=201 if created else 200, headers=SECURITY_HEADERS)

        return endpoint

    async def status(_request: Request, _caller: Caller) -> Any:
        """GET /status: the overview."""
        return await run_in_threadpool(
            overview.overview, store, console.mode, console.settings.count_limit, console.throughput,
            console.correlated,
        )

    async def charts(request: Request, _caller: Caller) -> Any:
        """GET /charts?window=1h|24h: the overview's chart series."""
        window = request.query_params.get("window", "1h")
        return await run_in_threadpool(overview.charts, store, window, console.sample_interval)

    async def list_messages(request: Request, _caller: Caller) -> Any:
        """GET /messages: a keyset page under the filters."""
        wanted, after, limit = messages.parse_listing(dict(request.query_params))
        return await run_in_threadpool(messages.messages_page, store, wanted, after, limit)

    async def one_message(request: Request, _caller: Caller) -> Any:
        """GET /messages/{id or message_id}: one message, whole (a message_id may hold slashes)."""
        reference = request.path_params["reference"]
        if reference in BULK_ACTIONS:  # the bulk action of that name, asked with the wrong method
            raise MethodNotAllowed(f"{reference} is a bulk action: POST /api/v1/messages/{reference}", ["POST"])
        return await run_in_threadpool(messages.message_detail, store, reference)

    async def bulk(request: Request, caller: Caller) -> Any:
        """POST /messages/{action}: a bulk action on a filter, or its count with dry_run."""
        action = request.path_params["action"]
        body = await json_body(request)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise BadRequest("'dry_run' must be true or false")
        if action not in BULK_ACTIONS:
            raise NotFound(f"no bulk action {action!r}; use one of {', '.join(BULK_ACTIONS)}")
        if not dry_run and not caller.can_write:
            raise Forbidden(f"the token {caller.name!r} may only read; {action} needs CORRELATION_ADMIN__TOKEN")
        selection, everything = messages.parse_selection(body)
        return await run_in_threadpool(
            lambda: messages.bulk(
                store, caller, action, selection, everything, dry_run=dry_run, chunk=console.settings.chunk_size,
                count_limit=console.settings.count_limit,
            )
        )

    async def hint(request: Request, _caller: Caller) -> Any:
        """GET /hints/{hint}: its messages in order, the blocker marked with why."""
        params = dict(request.query_params)
        unknown = sorted(set(params) - {"after", "limit"})
        if unknown:
            raise BadRequest(f"unknown parameter(s) {', '.join(unknown)}; use after and limit")
        _, after, limit = messages.parse_listing(params)
        return await run_in_threadpool(
            messages.hint_view, store, console.mode, request.path_params["hint"], after, limit
        )

    async def list_pauses(_request: Request, _caller: Caller) -> Any:
        """GET /pauses: the durable pauses."""
        return {"items": await run_in_threadpool(pauses.list_pauses, store)}

    async def add_pause(request: Request, caller: Caller) -> Any:
        """POST /pauses: a durable pause of a name, a hint or everything."""
        scope, target, reason = pauses.parse_pause(await json_body(request))
        return await run_in_threadpool(pauses.add_pause, store, caller, scope, target, reason)

    async def lift_pause(request: Request, caller: Caller) -> Any:
        """DELETE /pauses/{id}: lift a pause."""
        pause_id = request.path_params["pause_id"]
        return await run_in_threadpool(
            lambda: pauses.lift_pause(store, caller, pause_id, chunk=console.settings.chunk_size)
        )

    async def audit_trail(request: Request, _caller: Caller) -> Any:
        """GET /audit: the audit, newest first."""
        before, limit = audit.parse_page(dict(request.query_params))
        return await run_in_threadpool(audit.audit_page, store, before, limit)

    async def list_schedules(_request: Request, _caller: Caller) -> Any:
        """GET /schedules: the scheduler's switch and every schedule."""
        return await run_in_threadpool(schedules.schedules_list, store)

    async def add_schedule(request: Request, caller: Caller) -> Any:
        """POST /schedules: add a schedule."""
        body = await json_body(request)
        return await run_in_threadpool(schedule_actions.add, store, caller, body)

    async def one_schedule(request: Request, _caller: Caller) -> Any:
        """GET /schedules/{name}: its status (next fire times, running, last error, counts)."""
        name = request.path_params["name"]
        if name.endswith("/fire"):  # the fire action of a schedule, asked with the wrong method
            raise MethodNotAllowed(f"firing a schedule is POST /api/v1/schedules/{name}", ["POST"])
        return await run_in_threadpool(schedules.schedule_show, store, name)

    async def patch_schedule(request: Request, caller: Caller) -> Any:
        """PATCH /schedules/{name}: enable or disable it."""
        body = await json_body(request)
        return await run_in_threadpool(schedule_actions.patch, store, caller, request.path_params["name"], body)

    async def delete_schedule(request: Request, caller: Caller) -> Any:
        """DELETE /schedules/{name}: delete it (its messages stay)."""
        return await run_in_threadpool(schedule_actions.delete, store, caller, request.path_params["name"])

    async def fire_schedule(request: Request, caller: Caller) -> Any:
        """POST /schedules/{name}/fire: publish its message now with an action."""
        body = await json_body(request)
        unknown = sorted(set(body) - {"action"})
        if unknown:
            raise BadRequest(f"unknown field(s) {', '.join(unknown)}; firing takes only \"action\"")
        action = body.get("action", "start")
        if not isinstance(action, str):
            raise BadRequest(f"'action' must be one of {', '.join(schedules.ACTIONS)}")
        return await run_in_threadpool(schedule_actions.fire, store, caller, request.path_params["name"], action)

    async def switch_scheduler(request: Request, caller: Caller) -> Any:
        """POST /scheduler/{enable|disable}: the whole scheduler on or off."""
        switch = request.path_params["switch"]
        if switch not in ("enable", "disable"):
            raise NotFound(f"no scheduler action {switch!r}; use enable or disable")
        return await run_in_threadpool(schedule_actions.set_enabled, store, caller, None, switch == "enable")

    async def http_error(_request: Request, error: Exception) -> Response:
        """The router's own errors (no such route, wrong method) as JSON."""
        if isinstance(error, HTTPException):
            if error.status_code == 404:
                return error_response(404, "no such route; see docs/guides/console.md for the routes")
            return error_response(error.status_code, str(error.detail))
        return error_response(500, "internal error")

    routes = [
        Route("/status", guarded(status), methods=["GET"]),
        Route("/charts", guarded(charts), methods=["GET"]),
        Route("/messages", guarded(list_messages), methods=["GET"]),
        Route("/messages/{action}", guarded(bulk), methods=["POST"]),
        Route("/messages/{reference:path}", guarded(one_message), methods=["GET"]),
        Route("/hints/{hint:path}", guarded(hint), methods=["GET"]),
        Route("/pauses", guarded(list_pauses), methods=["GET"]),
        Route("/pauses", guarded(add_pause, write=True, created=True), methods=["POST"]),
        Route("/pauses/{pause_id:int}", guarded(lift_pause, write=True), methods=["DELETE"]),
        Route("/audit", guarded(audit_trail), methods=["GET"]),
        Route("/schedules", guarded(list_schedules), methods=["GET"]),
        Route("/schedules", guarded(add_schedule, write=True, created=True), methods=["POST"]),
        Route("/schedules/{name:path}/fire", guarded(fire_schedule, write=True), methods=["POST"]),
        Route("/schedules/{name:path}", guarded(one_schedule), methods=["GET"]),
        Route("/schedules/{name:path}", guarded(patch_schedule, write=True), methods=["PATCH"]),
        Route("/schedules/{name:path}", guarded(delete_schedule, write=True), methods=["DELETE"]),
        Route("/scheduler/{switch}", guarded(switch_scheduler, write=True), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
