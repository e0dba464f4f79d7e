"""Request-scoped dependencies: database session (commit on success, roll back on error), settings, principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from planner_service.api.errors import ApiError
from planner_service.api.ratelimit import TokenBuckets, retry_after_header
from planner_service.auth import ANONYMOUS, Principal, digest, resolve
from planner_service.db.change_feed import ChangeFeed
from planner_service.db.session import Database
from planner_service.settings import Settings


# Trivial dependencies are `async def`: FastAPI runs sync dependencies through its thread pool, a hop
# that cost more than the work itself on every request.
async def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.session() as s:
        yield s


UI_PREFIX = "/ui/"
UI_TOKEN_COOKIE = "memplan_token"


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (None if absent or another scheme)."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def rate_key(settings: Settings, principal: Principal, client_host: str | None) -> str:
    """Whose rate-limit bucket a request draws from: its token's with auth on, else its client address's."""
    return principal.rate_key if settings.auth else f"client:{client_host or '?'}"


async def get_principal(request: Request) -> Principal:
    """Who is asking: the token's project when auth is on, the default project when it is off; rate-limited.
    (No sub-dependencies: FastAPI's resolution of each costs more than a poll's own work.)"""
    db: Database = request.app.state.db
    settings: Settings = request.app.state.settings
    principal = ANONYMOUS
    if settings.auth:
        header = request.headers.get("authorization", "")
        token = bearer_token(header)
        if not header and request.url.path.startswith(UI_PREFIX):
            # The history pages (GET only) also take the token from the login cookie; the API never
            # does, so no cross-site form can act with a browser's credentials.
            token = request.cookies.get(UI_TOKEN_COOKIE, "").strip() or None
        if token is None:
            raise ApiError(
                401,
                "missing bearer token (Authorization: Bearer mp_...)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        found = await _principal(request, db, token)
        if found is None:
            raise ApiError(401, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"})
        principal = found
    buckets: TokenBuckets = request.app.state.rate_limiter
    wait = buckets.take(rate_key(settings, principal, request.client.host if request.client else None))
    if wait > 0:
        raise ApiError(429, "rate limit exceeded", headers={"Retry-After": retry_after_header(wait)})
    request.state.project_id = principal.project_id
    return principal


async def _principal(request: Request, db: Database, token: str) -> Principal | None:
    """Who the token is: from the change feed's memory when it has seen the token since the last token
    change (revocations empty it at commit), else one query by digest."""
    feed: ChangeFeed | None = request.app.state.change_feed
    key = digest(token)
    if feed is not None and (known := feed.token_owner(key)) is not None:
        return Principal(project_id=known[0], token_id=known[1])
    generation = feed.generation if feed is not None else 0
    found = await run_in_threadpool(_resolve, db, token)
    if feed is not None and found is not None and found.token_id is not None:
        feed.keep_token_owner(key, found.project_id, found.token_id, generation)
    return found


def _resolve(db: Database, token: str) -> Principal | None:
    with db.session() as s:
        return resolve(s, token)


# scope="function": the session commits when the endpoint returns, before the response is sent, so a client
# that reads right after a 201/202 always sees what was written.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_db)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
