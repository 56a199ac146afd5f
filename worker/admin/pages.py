"""The console's pages under ``/ui``: server-rendered Jinja2 templates (HTML escaped by default), no JavaScript
build step (one small static script refreshes the overview).

Login with a token sets the session cookie (see :mod:`worker.admin.auth`); every form carries the session's
CSRF token, checked before anything is done. Every page reads O(page) rows: lists are keyset pages, counts are
bounded, and the console's queries run under its statement timeout.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.admin import audit, messages, overview, pauses, schedule_actions, schedules
from worker.admin.auth import LOGIN_COOKIE, SESSION_COOKIE, Session
from worker.admin.console import Console
from worker.admin.errors import AdminError, BadRequest, refuse_nul
from worker.db.console import BULK_ACTIONS
from worker.db.store import DatabaseBusy, DatabaseUnavailable, MessageFilter, StoreError

if TYPE_CHECKING:
    from starlette.templating import Jinja2Templates

HERE = Path(__file__).resolve().parent
FLASH_COOKIE = "cw_flash"
REFRESH_MS = 2000  # how often the overview refreshes itself
CHARTS_MS = 5000  # how often its charts read their series again
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]

Handler = Callable[[Request, Session, FormData | None], Awaitable[Response]]


class SecurityHeaders:
    """Adds the pages' security headers (CSP, no framing, no sniffing, no caching) to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; add the headers to the response's start."""

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def _when(value: Any) -> str:
    """An ISO time as ``2026-11-22 13:40:05Z`` (UTC)."""
    if not value:
        return ""
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    return parsed.strftime("%Y-%m-%d %H:%M:%S") + ("Z" if parsed.utcoffset() is not None else "")


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _query(values: Mapping[str, Any]) -> str:
    return urlencode({key: value for key, value in values.items() if value not in (None, "")})


def _safe_next(ui: str, target: str | None) -> str:
    """Only a path of this console may be a redirect target (no open redirect)."""
    if target and target.startswith(ui + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return ui + "/"


def _form_filter(form: Mapping[str, Any]) -> tuple[MessageFilter, bool]:
    data: dict[str, Any] = {}
    for key in ("name", "hint", "state"):
        if form.get(key):
            data[key] = form[key]
    if form.get("ids"):
        data["ids"] = [part for part in str(form["ids"]).replace(",", " ").split() if part]
    if form.get("all") in ("1", "true", "on"):
        data["all"] = True
    return messages.parse_selection(data)


def pages_application(console: Console) -> Starlette:
    """The pages' routes on the console."""
    store = console.store
    auth = console.auth
    loaded: list[Jinja2Templates] = []

    def templates() -> Jinja2Templates:
        """The templates, loaded by the first page asked for (a replica nobody browses never loads Jinja2)."""
        if not loaded:
            from starlette.templating import Jinja2Templates

            built = Jinja2Templates(directory=str(HERE / "templates"))
            env = built.env
            env.filters["segment"] = lambda value: quote(str(value), safe="")
            env.filters["query"] = _query
            env.filters["when"] = _when
            env.filters["pretty"] = _pretty
            env.filters["age"] = messages.duration_text
            loaded.append(built)
        return loaded[0]

    def ui(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def render(
        request: Request, name: str, session: Session | None, status: int = 200, **context: Any
    ) -> Response:
        flash = request.cookies.get(FLASH_COOKIE)
        response = templates().TemplateResponse(
            request,
            name,
            {
                "ui": ui(request),
                "session": session,
                "can_write": session is not None and session.caller.can_write,
                "csrf": auth.csrf_token(session) if session is not None else "",
                "flash": flash,
                **context,
            },
            status_code=status,
        )
        if flash:
            response.delete_cookie(FLASH_COOKIE, path=ui(request) or "/")
        return response

    def redirect(request: Request, target: str, flash: str | None = None) -> Response:
        response = RedirectResponse(target, status_code=303)
        if flash:
            response.set_cookie(
                FLASH_COOKIE, flash[:300], max_age=60, path=ui(request) or "/", httponly=True, samesite="strict",
                secure=request.url.scheme == "https",
            )
        return response

    def page(handler: Handler, *, write: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """The handler behind the session check and, for a POST, the CSRF (and write) check."""
        async def endpoint(request: Request) -> Response:
            session = auth.session(request.cookies.get(SESSION_COOKIE))
            try:
                try:
                    return await checked(request, session)
                except DatabaseUnavailable:
                    if request.method != "GET":
                        raise
                    # A connection the server dropped (a restart while the console was idle) is let go with the
                    # pool's older ones: a read goes once more, on a fresh one. An action is never sent twice.
                    return await checked(request, session)
            except StoreError as error:  # the session's own check included: a readable page, never a bare 500
                return database_trouble(request, session, error)

        async def checked(request: Request, session: Session | None) -> Response:
            if session is not None and await run_in_threadpool(store.session_ended, auth.ended_key(session)):
                session = None  # logged out: a copy of the cookie opens nothing
            if session is None:
                if request.method == "GET":
                    wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                    return RedirectResponse(f"{ui(request)}/login?{_query({'next': wanted})}", status_code=303)
                return render(request, "error.html", None, 403, title="Logged out",
                              error="your session has ended: log in again, then repeat the action")
            form = None
            if request.method == "POST":
                form = await request.form()
                if not auth.csrf_ok(session, _text(form.get("csrf"))):
                    return render(request, "error.html", session, 403, title="Form refused",
                                  error="the form has expired or did not come from this console: reload the page "
                                        "and try again")
                if write and not session.caller.can_write:
                    return render(request, "error.html", session, 403, title="Read-only",
                                  error=f"the token {session.caller.name!r} may only read; acting needs "
                                        "CORRELATION_ADMIN__TOKEN")
            try:
                refuse_nul(request.url.path, *(f"{k}={v}" for k, v in request.query_params.multi_items()))
                return await handler(request, session, form)
            except AdminError as error:
                return render(request, "error.html", session, error.status, title="Not done", error=str(error))

        return endpoint

    def database_trouble(request: Request, session: Session | None, error: StoreError) -> Response:
        """A 503 page naming what the database could not do, and what to do about it."""
        if isinstance(error, DatabaseBusy):
            return render(request, "error.html", session, 503, title="Too slow",
                          error=f"the database gave up the request ({error}); a statement timeout is "
                                "CORRELATION_ADMIN__STATEMENT_TIMEOUT: narrow the filter or try again")
        title = "No database" if isinstance(error, DatabaseUnavailable) else "Database trouble"
        return render(request, "error.html", session, 503, title=title,
                      error=f"{error}; the console shows this page until the database answers again: reload then")

    # -- login ------------------------------------------------------------------------------------------------

    async def login_form(request: Request) -> Response:
        """GET /login: the login form."""
        nonce = request.cookies.get(LOGIN_COOKIE) or auth.login_nonce()
        response = render(request, "login.html", None, title="Log in", login_csrf=nonce,
                          next=_safe_next(ui(request), request.query_params.get("next")), error=None)
        response.set_cookie(LOGIN_COOKIE, nonce, max_age=3600, path=ui(request) or "/", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        return response

    async def login(request: Request) -> Response:
        """POST /login: check the token and start a session (a cookie), then go on to the page asked for."""
        form = await request.form()
        target = _safe_next(ui(request), _text(form.get("next")))
        cookie = request.cookies.get(LOGIN_COOKIE)
        if not auth.login_nonce_ok(cookie, _text(form.get("csrf"))):
            return render(request, "login.html", None, 403, title="Log in", login_csrf=cookie or auth.login_nonce(),
                          next=target, error="the login form has expired: enter the token again")
        caller = auth.check_token(_text(form.get("token")) or "", "ui")
        if caller is None:
            return render(request, "login.html", None, 401, title="Log in", login_csrf=cookie, next=target,
                          error="wrong token")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            SESSION_COOKIE, auth.new_session(caller), max_age=int(console.settings.session_lifetime.total_seconds()),
            path=ui(request) or "/", httponly=True, samesite="strict", secure=request.url.scheme == "https",
        )
        response.delete_cookie(LOGIN_COOKIE, path=ui(request) or "/")
        return response

    async def logout(request: Request, session: Session, _form: FormData | None) -> Response:
        """POST /logout: end the session on every replica."""
        ends = datetime.fromtimestamp(session.expires, UTC)
        await run_in_threadpool(store.sessions_end, auth.ended_key(session), ends)
        response = RedirectResponse(f"{ui(request)}/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=ui(request) or "/")
        return response

    # -- overview ---------------------------------------------------------------------------------------------

    def read_overview() -> dict[str, Any]:
        return overview.overview(
            store, console.mode, console.settings.count_limit, console.throughput, console.correlated
        )

    async def overview_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /: the overview: counts by state, oldest eligible age, throughput, pauses, replicas, charts."""
        data = await run_in_threadpool(read_overview)
        return render(request, "overview.html", session, title="Overview", section="overview", data=data,
                      refresh_ms=REFRESH_MS, charts_ms=CHARTS_MS,
                      sample_seconds=round(console.sample_interval.total_seconds(), 1))

    async def overview_live(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /overview/live: the overview's body, which the page reloads in place every 2 s."""
        data = await run_in_threadpool(read_overview)
        return render(request, "_overview_body.html", session, data=data)

    async def overview_charts(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /overview/charts?window=1h|24h: the overview's charts."""
        window = request.query_params.get("window", "1h")
        data = await run_in_threadpool(overview.charts, store, window, console.sample_interval)
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    # -- messages ---------------------------------------------------------------------------------------------

    async def messages_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /messages: a keyset page of messages under the API's filters."""
        params = dict(request.query_params)
        wanted, after, limit = messages.parse_listing(params)
        data = await run_in_threadpool(messages.messages_page, store, wanted, after, limit)
        filters = {key: params.get(key, "") for key in
                   ("state", "name", "hint", "message_id", "error", "created_from", "created_to")}
        return render(request, "messages.html", session, title="Messages", section="messages", data=data,
                      filters=filters, states=["ready", "paused", "dead", "delivered"])

    async def message_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /messages/{id or message_id}: one message, whole, with its actions."""
        data = await run_in_threadpool(messages.message_detail, store, request.path_params["reference"])
        return render(request, "message.html", session, title=f"Message {data['id']}", section="messages",
                      message=data)

    async def message_action(request: Request, session: Session, _form: FormData | None) -> Response:
        """POST /messages/{id}/{action}: requeue, pause, resume or delete one message."""
        row_id, action = request.path_params["row_id"], request.path_params["action"]
        if action not in BULK_ACTIONS:
            raise BadRequest(f"no action {action!r}; use one of {', '.join(BULK_ACTIONS)}")
        result = await run_in_threadpool(
            messages.bulk, store, session.caller, action, MessageFilter(ids=(row_id,)), False
        )
        done = result["affected"]
        note = f"{_past(action)} message {row_id}"
        if not done:
            note = f"message {row_id} was not {_past(action)}: its state did not allow it"
        target = f"{ui(request)}/messages" if action == "delete" and done else f"{ui(request)}/messages/{row_id}"
        return redirect(request, target, note)

    async def hint_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /hints/{hint}: its messages in order, the one holding it back highlighted with why."""
        _, after, limit = messages.parse_listing(dict(request.query_params))
        hint = request.path_params["hint"]
        data = await run_in_threadpool(messages.hint_view, store, console.mode, hint, after, limit)
        pause = await run_in_threadpool(store.pauses_find, "hint", hint)
        return render(request, "hint.html", session, title=f"Hint {hint}", section="messages", data=data,
                      pause=pause)

    # -- dead letters and bulk actions -----------------------------------------------------------------------

    async def dead_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /dead: the dead letters, filtered by name and hint."""
        params = {key: value for key, value in request.query_params.items() if key in ("name", "hint", "after")}
        wanted, after, limit = messages.parse_listing({**params, "state": "dead"})
        data = await run_in_threadpool(messages.messages_page, store, wanted, after, limit)
        filters = {"name": params.get("name", ""), "hint": params.get("hint", "")}
        return render(request, "dead.html", session, title="Dead letters", section="dead", data=data,
                      filters=filters)

    async def bulk_confirm(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /bulk: the confirmation of a bulk action, with the (bounded) count it would change."""
        params = dict(request.query_params)
        action = params.get("action", "")
        if action not in BULK_ACTIONS:
            raise BadRequest(f"no bulk action {action!r}; use one of {', '.join(BULK_ACTIONS)}")
        selection, everything = _form_filter(params)
        preview = await run_in_threadpool(
            lambda: messages.bulk(store, session.caller, action, selection, everything, dry_run=True,
                                  count_limit=console.settings.count_limit)
        )
        back = _safe_next(ui(request), params.get("back"))
        return render(request, "confirm.html", session, title=f"Confirm {action}", section="dead", action=action,
                      preview=preview, fields=messages.selection_as_dict(selection, everything), back=back)

    async def bulk_apply(request: Request, session: Session, form: FormData | None) -> Response:
        """POST /bulk: apply a confirmed bulk action."""
        assert form is not None
        action = _text(form.get("action")) or ""
        if action not in BULK_ACTIONS:
            raise BadRequest(f"no bulk action {action!r}; use one of {', '.join(BULK_ACTIONS)}")
        selection, everything = _form_filter({key: _text(value) for key, value in form.items()})
        result = await run_in_threadpool(
            lambda: messages.bulk(store, session.caller, action, selection, everything,
                                  chunk=console.settings.chunk_size, count_limit=console.settings.count_limit)
        )
        back = _safe_next(ui(request), _text(form.get("back")))
        return redirect(request, back, f"{_past(action)} {result['affected']} messages")

    # -- pauses and audit ------------------------------------------------------------------------------------------

    async def pauses_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /pauses: the durable pauses."""
        items = await run_in_threadpool(pauses.list_pauses, store)
        return render(request, "pauses.html", session, title="Pauses", section="pauses", items=items)

    async def pause_add(request: Request, session: Session, form: FormData | None) -> Response:
        """POST /pauses: pause a name, a hint or everything, with a reason."""
        assert form is not None
        scope = _text(form.get("scope")) or ""
        data: dict[str, Any] = {"reason": _text(form.get("reason")) or ""}
        if scope == "all":
            data["all"] = True
        elif scope in ("name", "hint"):
            data[scope] = _text(form.get("target")) or None
        else:
            raise BadRequest("choose what to pause: a message name, a hint, or everything")
        parsed = pauses.parse_pause(data)
        shown = await run_in_threadpool(pauses.add_pause, store, session.caller, *parsed)
        back = _safe_next(ui(request), _text(form.get("back")) or f"{ui(request)}/pauses")
        return redirect(request, back, f"paused {pauses.describe(shown['scope'], shown['target'] or '')} "
                                       f"(pause {shown['id']})")

    async def pause_lift(request: Request, session: Session, form: FormData | None) -> Response:
        """POST /pauses/{id}/lift: lift a durable pause."""
        assert form is not None
        pause_id = request.path_params["pause_id"]
        result = await run_in_threadpool(
            lambda: pauses.lift_pause(store, session.caller, pause_id, chunk=console.settings.chunk_size)
        )
        lifted = result["lifted"]
        back = _safe_next(ui(request), _text(form.get("back")) or f"{ui(request)}/pauses")
        return redirect(request, back, f"lifted the pause of {pauses.describe(lifted['scope'], lifted['target'] or '')}"
                                       f" ({result['resumed']} messages resumed)")

    async def audit_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /audit: who did what, newest first."""
        before, limit = audit.parse_page(dict(request.query_params))
        data = await run_in_threadpool(audit.audit_page, store, before, limit)
        return render(request, "audit.html", session, title="Audit", section="audit", data=data)

    # -- schedules -------------------------------------------------------------------------------------------------

    async def schedules_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /schedules: every schedule and the scheduler's switch."""
        data = await run_in_threadpool(schedules.schedules_list, store)
        return render(request, "schedules.html", session, title="Schedules", section="schedules", data=data,
                      actions=schedules.ACTIONS, misfires=schedules.MISFIRE_POLICIES)

    async def schedule_page(request: Request, session: Session, _form: FormData | None) -> Response:
        """GET /schedules/{name}: one schedule's next fire times, pending message and last error."""
        data = await run_in_threadpool(schedules.schedule_show, store, request.path_params["name"])
        return render(request, "schedule.html", session, title=f"Schedule {data['name']}", section="schedules",
                      schedule=data, actions=schedules.ACTIONS)

    async def schedule_add(request: Request, session: Session, form: FormData | None) -> Response:
        """POST /schedules: add a schedule."""
        assert form is not None
        fields = {key: _text(form.get(key)) or None for key in
                  ("name", "cron", "message_name", "correlation_hint", "time_zone", "misfire")}
        data: dict[str, Any] = {key: value for key, value in fields.items() if value is not None}
        for key in ("payload", "headers"):
            raw = (_text(form.get(key)) or "").strip()
            if raw:
                try:
                    data[key] = json.loads(raw)
                except ValueError as error:
                    raise BadRequest(f"the {key} is not valid JSON ({error})") from None
        data["singleton"] = form.get("singleton") == "on"
        shown = await run_in_threadpool(schedule_actions.add, store, session.caller, data)
        return redirect(request, f"{ui(request)}/schedules", f"added schedule {shown['name']!r}")

    async def schedule_action(request: Request, session: Session, form: FormData | None) -> Response:
        """POST /schedules/{name}/{enable|disable|fire|delete}: act on one schedule."""
        assert form is not None
        name, verb = request.path_params["name"], request.path_params["verb"]
        back = f"{ui(request)}/schedules"
        if verb in ("enable", "disable"):
            await run_in_threadpool(schedule_actions.set_enabled, store, session.caller, name, verb == "enable")
            note = f"{verb}d schedule {name!r}"
        elif verb == "fire":
            action = _text(form.get("action")) or "start"
            fired = await run_in_threadpool(schedule_actions.fire, store, session.caller, name, action)
            note = f"fired schedule {name!r} ({action}): message {fired['id']}"
        elif verb == "delete":
            await run_in_threadpool(schedule_actions.delete, store, session.caller, name)
            note = f"deleted schedule {name!r}"
        else:
            raise BadRequest(f"no schedule action {verb!r}; use enable, disable, fire or delete")
        return redirect(request, _safe_next(ui(request), _text(form.get("back")) or back), note)

    async def scheduler_switch(request: Request, session: Session, _form: FormData | None) -> Response:
        """POST /scheduler/{enable|disable}: the whole cluster's scheduler on or off."""
        switch = request.path_params["switch"]
        if switch not in ("enable", "disable"):
            raise BadRequest(f"no scheduler action {switch!r}; use enable or disable")
        await run_in_threadpool(schedule_actions.set_enabled, store, session.caller, None, switch == "enable")
        return redirect(request, f"{ui(request)}/schedules", f"the scheduler is {switch}d")

    routes = [
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", page(logout), methods=["POST"]),
        Route("/", page(overview_page), methods=["GET"]),
        Route("/overview/live", page(overview_live), methods=["GET"]),
        Route("/overview/charts", page(overview_charts), methods=["GET"]),
        Route("/messages", page(messages_page), methods=["GET"]),
        Route("/messages/{row_id:int}/{action}", page(message_action, write=True), methods=["POST"]),
        Route("/messages/{reference:path}", page(message_page), methods=["GET"]),
        Route("/hints/{hint:path}", page(hint_page), methods=["GET"]),
        Route("/dead", page(dead_page), methods=["GET"]),
        Route("/bulk", page(bulk_confirm), methods=["GET"]),
        Route("/bulk", page(bulk_apply, write=True), methods=["POST"]),
        Route("/pauses", page(pauses_page), methods=["GET"]),
        Route("/pauses", page(pause_add, write=True), methods=["POST"]),
        Route("/pauses/{pause_id:int}/lift", page(pause_lift, write=True), methods=["POST"]),
        Route("/audit", page(audit_page), methods=["GET"]),
        Route("/schedules", page(schedules_page), methods=["GET"]),
        Route("/schedules", page(schedule_add, write=True), methods=["POST"]),
        Route("/schedules/{name:path}/{verb}", page(schedule_action, write=True), methods=["POST"]),
        Route("/schedules/{name:path}", page(schedule_page), methods=["GET"]),
        Route("/scheduler/{switch}", page(scheduler_switch, write=True), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(SecurityHeaders)
    return app


def _text(value: Any) -> str | None:
    """A form field's text (None for a missing field or an upload)."""
    return value if isinstance(value, str) else None


def _past(action: str) -> str:
    return {"requeue": "requeued", "pause": "paused", "resume": "resumed", "delete": "deleted"}.get(action, action)

