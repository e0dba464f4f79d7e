"""The hardware catalogue: the shipped entries, every one sourced in the docs, and users' additions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.contract import HardwareCatalog
from planner_service.whatif.catalog import (
    CATALOG_ENV,
    CatalogError,
    entry,
    load_catalog,
    shipped,
    to_hardware,
)

REPO = Path(__file__).resolve().parents[3]
REQUIRED = [
    "a100-40gb-pcie",
    "a100-80gb-pcie",
    "a100-40gb-sxm",
    "a100-80gb-sxm",
    "h100-pcie",
    "h100-sxm",
    "h200",
    "gh200",
    "l4",
    "l40s",
    "a10g",
    "rtx-3090",
    "rtx-4090",
    "rtx-5090",
    "mi300x",
]


def _memplan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_shipped_catalogue_has_the_accelerators_people_train_on() -> None:
    keys = [e.key for e in shipped().entries]
    assert len(keys) >= 12
    assert set(REQUIRED) <= set(keys)


def test_every_entry_and_figure_is_sourced_in_the_hardware_docs() -> None:
    doc = (REPO / "docs" / "architecture" / "hardware.md").read_text()
    for e in shipped().entries:
        assert f"`{e.key}`" in doc, f"{e.key} has no row in docs/architecture/hardware.md"
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{e.key}`"))
        assert "http" in row or "[" in row, f"{e.key}: its row cites no source"


def test_entries_become_contract_hardware_with_host_overrides() -> None:
    e = entry(load_catalog(use_env=False), "rtx-3090")
    hw = to_hardware(e, host_memory_bytes=384 * 2**30)
    assert hw.device_memory_bytes == 24 * 2**30 and hw.host_memory_bytes == 384 * 2**30
    assert hw.cpu_cores == e.cpu_cores
    big = hw.bandwidth.h2d_pinned[-1]
    assert 0.9 * e.host_link.h2d_bytes_per_s < big.bytes_per_s <= e.host_link.h2d_bytes_per_s


def test_user_file_adds_and_replaces_entries(tmp_path: Path) -> None:
    mine = shipped().entries[0].model_copy(update={"key": "my-gpu", "name": "My GPU"})
    faster = entry(load_catalog(use_env=False), "l4").model_copy(update={"cpu_cores": 64})
    path = tmp_path / "mine.json"
    path.write_text(HardwareCatalog(entries=[mine, faster]).model_dump_json())
    cat = load_catalog([path], use_env=False)
    assert cat["my-gpu"].name == "My GPU" and cat["l4"].cpu_cores == 64
    assert len(cat) == len(shipped().entries) + 1


@pytest.mark.parametrize(
    "body,where",
    [
        ("{not json", "not JSON"),
        ('{"entries": []}', "entries"),
        ('{"entries": [{"key": "x"}]}', "entries.0.name"),
    ],
)
def test_bad_catalogue_files_are_refused_naming_the_field(tmp_path: Path, body: str, where: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(body)
    with pytest.raises(CatalogError, match=where):
        load_catalog([path], use_env=False)


def test_duplicate_keys_and_impossible_links_are_refused() -> None:
    e = shipped().entries[0].model_dump()
    with pytest.raises(ValueError, match="appears twice"):
        HardwareCatalog.model_validate({"entries": [e, e]})
    bad = json.loads(json.dumps(e))
    bad["host_link"]["h2d_bytes_per_s"] = bad["host_link"]["peak_bytes_per_s"] * 2
    with pytest.raises(ValueError, match="exceeds the link's peak"):
        HardwareCatalog.model_validate({"entries": [bad]})


def test_unknown_key_names_the_known_ones() -> None:
    with pytest.raises(CatalogError, match="not in the catalogue; known keys: .*h100-sxm"):
        entry(load_catalog(use_env=False), "h1000")


def test_cli_lists_the_catalogue_as_json_with_the_environment_file(tmp_path: Path) -> None:
    mine = shipped().entries[0].model_copy(update={"key": "lab-box", "name": "Lab box"})
    path = tmp_path / "lab.json"
    path.write_text(HardwareCatalog(entries=[mine]).model_dump_json())
    out = _memplan("hardware", "catalog", "--json", env={CATALOG_ENV: str(path)})
    assert out.returncode == 0, out.stderr
    keys = [e.key for e in HardwareCatalog.model_validate_json(out.stdout).entries]
    assert "lab-box" in keys and set(REQUIRED) <= set(keys)
    table = _memplan("hardware", "catalog")
    assert table.returncode == 0 and "h100-sxm" in table.stdout


def test_cli_refuses_a_bad_catalogue_file_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"entries": [{"key": "UPPER"}]}')
    out = _memplan("hardware", "catalog", "--catalog", str(path))
    assert out.returncode == 2 and "bad.json" in out.stderr
