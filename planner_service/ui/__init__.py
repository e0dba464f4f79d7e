"""History UI: server-rendered pages (Jinja2, inline SVG, no JavaScript) for browsing plans.

Include it in the app with `app.include_router(ui.router)` (`from planner_service import ui`).
"""

from planner_service.ui.router import router

__all__ = ["router"]
