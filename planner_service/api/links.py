"""OpenAPI links: which response field feeds which request (an upload's id -> GET the trace, request a plan;
a plan's id -> poll it, send feedback; a list's first item and next cursor). They document how the API is
walked, and schemathesis's stateful phase follows them with real ids (tests/planner_service/fuzz)."""

from __future__ import annotations

from typing import Any

GET_TRACE = "#/paths/~1v1~1traces~1{trace_id}/get"
LIST_TRACES = "#/paths/~1v1~1traces/get"
REQUEST_PLAN = "#/paths/~1v1~1plans/post"
GET_PLAN = "#/paths/~1v1~1plans~1{plan_id}/get"
LIST_PLANS = "#/paths/~1v1~1plans/get"
POST_FEEDBACK = "#/paths/~1v1~1plans~1{plan_id}~1feedback/post"


def _to_trace(id_expr: str) -> dict[str, Any]:
    return {
        "GetTrace": {
            "operationRef": GET_TRACE,
            "parameters": {"trace_id": id_expr},
            "description": "the trace just stored",
        },
        "RequestPlan": {
            "operationRef": REQUEST_PLAN,
            "requestBody": {"trace_id": id_expr},
            "description": "a plan for this trace",
        },
    }


def _to_plan(id_expr: str) -> dict[str, Any]:
    return {
        "GetPlan": {
            "operationRef": GET_PLAN,
            "parameters": {"plan_id": id_expr},
            "description": "poll the plan",
        },
        "PostFeedback": {
            "operationRef": POST_FEEDBACK,
            "parameters": {"plan_id": id_expr},
            "description": "what applying the plan measured",
        },
    }


TRACE_CREATED = _to_trace("$response.body#/id")
TRACE_PAGE = {
    **_to_trace("$response.body#/items/0/id"),
    "NextPage": {"operationRef": LIST_TRACES, "parameters": {"cursor": "$response.body#/next_cursor"}},
}
PLAN_RECORD = {
    **_to_plan("$response.body#/id"),
    "GetPlanTrace": {"operationRef": GET_TRACE, "parameters": {"trace_id": "$response.body#/trace_id"}},
}
PLAN_PAGE = {
    **_to_plan("$response.body#/items/0/id"),
    "NextPage": {"operationRef": LIST_PLANS, "parameters": {"cursor": "$response.body#/next_cursor"}},
}
