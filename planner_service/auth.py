"""API tokens and tenancy: tokens are random, stored as SHA-256 digests, and scope every request to a project."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy.orm import Session

from planner_service.db.base import utcnow
from planner_service.db.models import DEFAULT_PROJECT, ApiTokenRow, ProjectRow, new_id
from planner_service.db.repositories import AccessRepository

TOKEN_PREFIX = "mp_"


def digest(token: str) -> str:
    # A plain hash is right for 256-bit random tokens (no dictionary to protect against, unlike passwords).
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    project_id: str
    token_id: str | None  # None: auth is off (embedded/loopback service)

    @property
    def rate_key(self) -> str:
        return self.token_id or f"project:{self.project_id}"


ANONYMOUS = Principal(project_id=DEFAULT_PROJECT, token_id=None)


def ensure_project(session: Session, name: str) -> ProjectRow:
    access = AccessRepository(session)
    row = access.project_named(name)
    if row is None:
        row = ProjectRow(
            id=DEFAULT_PROJECT if name == DEFAULT_PROJECT else new_id(), name=name, created_at=utcnow()
        )
        access.add(row)
    return row


def create_token(session: Session, project: str, name: str = "") -> tuple[str, ApiTokenRow]:
    """A new token for `project` (created if missing). The clear text is returned once and never stored."""
    proj = ensure_project(session, project)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiTokenRow(
        project_id=proj.id,
        name=name or f"token for {project}",
        prefix=token[:10],
        digest=digest(token),
        created_at=utcnow(),
    )
    AccessRepository(session).add(row)
    return token, row


def revoke_token(session: Session, token_id: str) -> bool:
    row = AccessRepository(session).token(token_id)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    return True


def resolve(session: Session, token: str) -> Principal | None:
    row = AccessRepository(session).live_token(digest(token))
    return None if row is None else Principal(project_id=row.project_id, token_id=row.id)
