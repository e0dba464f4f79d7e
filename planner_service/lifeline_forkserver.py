"""Imported by the multiprocessing forkserver as it starts (`lifeline.forkserver_context`): from then on it
dies with the process that started it. Nothing else imports this module."""

from __future__ import annotations

import os

from planner_service.lifeline import PARENT_ENV, die_with_parent

_expected = os.environ.get(PARENT_ENV)
die_with_parent(int(_expected) if _expected and _expected.isdigit() else None)
