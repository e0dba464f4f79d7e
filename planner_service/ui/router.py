"""The history UI's routes: `/` -> `/ui/plans`, the plans list, one plan's page, and the stylesheet.

Server-rendered with Jinja2 (autoescape on for every template: model names and messages are user
input), no JavaScript and no build step. Bad query parameters get a 400 page naming the parameter.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from client.contract.common import NO_NUL_MESSAGE, has_nul
from client.units import format_bytes
from planner_service.api.deps import UI_TOKEN_COOKIE, DatabaseDep, PrincipalDep, SettingsDep
from planner_service.auth import resolve
from planner_service.db.keyset_cursor import BadCursor
from planner_service.db.repositories import PLAN_SORT_KEYS, search_terms
from planner_service.ui.compare import compare_page
from planner_service.ui.queries import (
    MAX_COMPARED,
    PLAN_STATUSES,
    PlanFilters,
    load_catalog,
    load_compared,
    load_plan_detail,
    load_plan_list,
)
from planner_service.ui.views import error_class, format_error, format_seconds, plan_page

PAGE_SIZES: tuple[int, ...] = (10, 25, 50, 100)
MAX_PAGE_SIZE = 100
MAX_FILTER_CHARS = 600

router = APIRouter(include_in_schema=False)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("planner_service.ui", "templates"),
        autoescape=True,  # every template, whatever its extension
        undefined=jinja2.StrictUndefined,  # a typo in a template is an error in tests, not a blank
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        bytes=lambda n: "—" if n is None else format_bytes(n),
        seconds=format_seconds,
        error=format_error,
        error_css=error_class,
    )
    return env


templates = Jinja2Templates(env=_environment())


@lru_cache(maxsize=1)
def _stylesheet() -> bytes:
    return files("planner_service.ui").joinpath("static/ui.css").read_bytes()


class BadQuery(ValueError):
    """A query parameter the page cannot use; the message names it."""


def _filters(request: Request) -> PlanFilters:
    q = request.query_params

    def text(name: str) -> str | None:
        value = q.get(name, "").strip()
        if len(value) > MAX_FILTER_CHARS:
            raise BadQuery(f"{name}: longer than {MAX_FILTER_CHARS} characters")
        if has_nul(value):
            raise BadQuery(f"{name}: {NO_NUL_MESSAGE}")
        return value or None

    status = text("status")
    if status is not None and status not in PLAN_STATUSES:
        raise BadQuery(f"status: {status!r} is not one of {', '.join(PLAN_STATUSES)}")
    sort = text("sort") or "-created_at"
    if sort.lstrip("-") not in PLAN_SORT_KEYS or sort.count("-") > 1:
        raise BadQuery(f"sort: {sort!r} is not one of {', '.join(PLAN_SORT_KEYS)} (with '-' for descending)")
    search = text("search")
    try:
        search_terms(search)
    except ValueError as exc:
        raise BadQuery(str(exc)) from None
    raw_limit = text("limit") or "25"
    try:
        limit = int(raw_limit)
    except ValueError:
        raise BadQuery(f"limit: {raw_limit!r} is not a whole number") from None
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise BadQuery(f"limit: {limit} is not between 1 and {MAX_PAGE_SIZE}")
    raw_world = text("world_size")
    world_size = None
    if raw_world is not None:
        if not raw_world.isdigit() or not 1 <= int(raw_world) <= 65_536:
            raise BadQuery(f"world_size: {raw_world!r} is not a number of ranks (1 to 65536)")
        world_size = int(raw_world)
    return PlanFilters(
        model=text("model"),
        hardware=text("hardware"),
        status=status,
        search=search,
        sort=sort,
        world_size=world_size,
        limit=limit,
        cursor=text("cursor"),
    )


def _query(filters: PlanFilters, **changes: Any) -> str:
    """The list page's query string for `filters` with `changes` applied (empty values left out)."""
    values = {
        "model": filters.model,
        "hardware": filters.hardware,
        "status": filters.status,
        "search": filters.search,
        "world_size": filters.world_size,
        "sort": None if filters.sort == "-created_at" else filters.sort,
        "limit": None if filters.limit == 25 else filters.limit,
        "cursor": filters.cursor,
    }
    values.update(changes)
    return urlencode({k: v for k, v in values.items() if v not in (None, "")})


SORTABLE_COLUMNS: dict[str, str] = {  # the plans table's sortable columns: header -> sort key
    "created (UTC)": "created_at",
    "model": "model",
    "hardware": "hardware",
    "workload": "workload",
    "solver": "solver",
    "status": "status",
    "device limit": "device_limit",
    "pred. iteration": "iteration",
    "pred. peak": "peak",
    "iteration error": "error",
    "peak error": "peak_error",
}
_DESCENDING_FIRST = {"created_at", "error", "peak_error"}  # newest, worst first on the first click


def _sort_links(filters: PlanFilters) -> dict[str, tuple[str, str]]:
    """Each sortable header's link (the same filters, this column, the first page) and its arrow: a click on
    the current column reverses it."""
    out = {}
    for header, key in SORTABLE_COLUMNS.items():
        if filters.sort_key == key:
            target = key if filters.descending else f"-{key}"
            arrow = " ▼" if filters.descending else " ▲"
        else:
            target = f"-{key}" if key in _DESCENDING_FIRST else key
            arrow = ""
        out[header] = (_query(filters, sort=None if target == "-created_at" else target, cursor=None), arrow)
    return out


def _error_page(request: Request, status_code: int, title: str, message: str) -> Response:
    return templates.TemplateResponse(
        request, "error.html", {"title": title, "message": message}, status_code=status_code
    )


@router.get("/", response_class=RedirectResponse)
def home() -> RedirectResponse:
    return RedirectResponse("/ui/plans", status_code=307)


@router.get("/ui", response_class=RedirectResponse)
def ui_home() -> RedirectResponse:
    return RedirectResponse("/ui/plans", status_code=307)


@router.get("/ui/static/ui.css")
def stylesheet() -> Response:
    return Response(_stylesheet(), media_type="text/css", headers={"cache-control": "public, max-age=3600"})


# Sync handlers: FastAPI runs them in its thread pool, so database reads and chart building
# never block the event loop.
@router.get("/ui/plans", response_class=HTMLResponse)
def plans_page(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    try:
        filters = _filters(request)
        with db.session() as s:
            page = load_plan_list(s, principal.project_id, filters)
    except (BadQuery, BadCursor) as exc:
        return _error_page(request, 400, "Bad request", str(exc))
    context = {
        "filters": filters,
        "page": page,
        "statuses": PLAN_STATUSES,
        "page_sizes": PAGE_SIZES,
        "next_query": _query(filters, cursor=page.next_cursor) if page.next_cursor else None,
        "first_query": _query(filters, cursor=None) if filters.cursor else None,
        "sort_links": _sort_links(filters),
        "max_compared": MAX_COMPARED,
    }
    return templates.TemplateResponse(request, "plans.html", context)


@router.get("/ui/plans/{plan_id}", response_class=HTMLResponse)
def plan_detail_page(request: Request, plan_id: str, db: DatabaseDep, principal: PrincipalDep) -> Response:
    if has_nul(plan_id):
        return _error_page(request, 400, "Bad request", f"plan_id: {NO_NUL_MESSAGE}")
    if len(plan_id) > 64:
        return _error_page(request, 404, "Plan not found", f"plan_id: no plan {plan_id[:64]!r}…")
    with db.session() as s:
        detail = load_plan_detail(s, principal.project_id, plan_id)
    if detail is None:
        return _error_page(request, 404, "Plan not found", f"plan_id: no plan {plan_id!r}")
    page = plan_page(detail.record, detail.trace)
    refresh = not detail.record.status.final
    return templates.TemplateResponse(
        request, "plan.html", {"p": page, "r": detail.record, "refresh": refresh}
    )


@router.get("/ui/compare", response_class=HTMLResponse)
def compare(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    """Two or more plans side by side (`?id=A&id=B...`, up to MAX_COMPARED); `diff=1`: differences only."""
    ids: list[str] = []
    for raw in request.query_params.getlist("id"):
        plan_id = raw.strip()
        if has_nul(plan_id):
            return _error_page(request, 400, "Bad request", f"id: {NO_NUL_MESSAGE}")
        if len(plan_id) > 64:
            return _error_page(request, 400, "Bad request", f"id: {plan_id[:64]!r}… is longer than a plan id")
        if plan_id and plan_id not in ids:
            ids.append(plan_id)
    if not 2 <= len(ids) <= MAX_COMPARED:
        return _error_page(
            request,
            400,
            "Bad request",
            f"id: pick 2 to {MAX_COMPARED} different plans to compare ({len(ids)} given)",
        )
    diff = request.query_params.get("diff", "")
    if diff not in ("", "0", "1"):
        return _error_page(request, 400, "Bad request", f"diff: {diff[:40]!r} is not 0 or 1")
    with db.session() as s:
        records, missing = load_compared(s, principal.project_id, ids)
    if missing:
        return _error_page(request, 404, "Plan not found", f"id: no plan {', '.join(map(repr, missing))}")
    page = compare_page(records, differences_only=diff == "1")
    base = [("id", r.id) for r in records]
    context = {
        "c": page,
        "all_query": urlencode(base),
        "diff_query": urlencode([*base, ("diff", "1")]),
    }
    return templates.TemplateResponse(request, "compare.html", context)


@router.get("/ui/catalog", response_class=HTMLResponse)
def catalog_page(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    with db.session() as s:
        catalog = load_catalog(s, principal.project_id)
    return templates.TemplateResponse(request, "catalog.html", {"catalog": catalog})


def _safe_next(value: str | None) -> str:
    """Only redirect within the UI after login (no open redirect to another site)."""
    return value if value and value.startswith("/ui/") and not value.startswith("//") else "/ui/plans"


@router.get("/ui/login", response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None) -> Response:  # noqa: A002 - the query name
    return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next), "message": None})


@router.post("/ui/login", response_class=HTMLResponse)
async def login(request: Request, db: DatabaseDep, settings: SettingsDep) -> Response:
    """Check the token once and keep it in an HttpOnly, SameSite=Strict cookie for the UI pages."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0].strip()
    nxt = _safe_next((form.get("next") or [""])[0])
    with db.session() as s:
        principal = resolve(s, token) if token else None
    if settings.auth and principal is None:
        return templates.TemplateResponse(
            request, "login.html", {"next": nxt, "message": "That token is not valid."}, status_code=401
        )
    response = RedirectResponse(nxt, status_code=303)
    response.set_cookie(
        UI_TOKEN_COOKIE,
        token,
        httponly=True,
        samesite="strict",
        path="/ui/",
        secure=request.url.scheme == "https",
        max_age=12 * 3600,
    )
    return response


@router.post("/ui/logout")
def logout() -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(UI_TOKEN_COOKIE, path="/ui/")
    return response
