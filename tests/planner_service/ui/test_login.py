"""With auth on, people log in to the history pages with a token kept in a cookie the API ignores."""

from __future__ import annotations

from fastapi.testclient import TestClient

from planner_service.app import create_app
from planner_service.auth import create_token
from planner_service.db.session import Database
from planner_service.settings import Settings


def test_ui_login_with_a_token_cookie_scoped_to_the_pages(settings: Settings) -> None:
    secure = settings.model_copy(update={"auth": True})
    db = Database(secure.database_url)
    with db.session() as s:
        token, _ = create_token(s, "team-ui")
    db.dispose()
    with TestClient(create_app(secure), follow_redirects=False) as c:
        r = c.get("/ui/plans")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")
        assert c.get("/ui/login").status_code == 200
        bad = c.post(
            "/ui/login",
            content="token=mp_nope&next=/ui/plans",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert bad.status_code == 401 and "not valid" in bad.text
        ok = c.post(
            "/ui/login",
            content=f"token={token}&next=https://evil.example/",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert ok.status_code == 303 and ok.headers["location"] == "/ui/plans"  # no open redirect
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui/" in cookie
        c.cookies.set("memplan_token", token)
        assert c.get("/ui/plans").status_code == 200
        assert c.get("/v1/plans").status_code == 401  # the API never takes the cookie
        out = c.post("/ui/logout")
        assert out.status_code == 303
