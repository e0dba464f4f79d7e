"""/v1/models and /v1/hardware: what the history holds, with counts, for browsing."""

from __future__ import annotations

from fastapi import APIRouter

from client.contract import HardwareSummary, ModelSummary
from planner_service.api.deps import PrincipalDep, SessionDep
from planner_service.api.errors import ERROR_RESPONSES
from planner_service.db.repositories import CatalogRepository

router = APIRouter(prefix="/v1", tags=["catalog"], responses=ERROR_RESPONSES)


@router.get("/models", response_model=list[ModelSummary])
def list_models(session: SessionDep, principal: PrincipalDep) -> list[ModelSummary]:
    return [
        ModelSummary(
            fingerprint=m.fingerprint,
            name=m.name,
            architecture=m.architecture,
            parameter_count=m.parameter_count,
            traces=t,
            plans=p,
        )
        for m, t, p in CatalogRepository(session).models(principal.project_id)
    ]


@router.get("/hardware", response_model=list[HardwareSummary])
def list_hardware(session: SessionDep, principal: PrincipalDep) -> list[HardwareSummary]:
    return [
        HardwareSummary(
            key=h.key,
            device_type=h.device_type,
            device_name=h.device_name,
            device_memory_bytes=h.device_memory_bytes,
            device_count=h.device_count,
            traces=t,
            plans=p,
            world_size=h.world_size,
            ranks_per_node=h.ranks_per_node,
        )
        for h, t, p in CatalogRepository(session).hardware(principal.project_id)
    ]
