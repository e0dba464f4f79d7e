"""Reading the CUDA caching allocator's history: allocations, frees, blocks and saved tensors matched.

No GPU here, so the snapshot is written out by hand in the documented `TraceEntry` format
(`torch.cuda.memory._snapshot()["device_traces"][i]`); the parsing is the same code the CUDA path runs.
"""

from __future__ import annotations

import torch

from agent.profiler.cuda_history import CudaAllocatorHistory
from client.contract import Phase


def test_history_entries_become_records_with_blocks_frees_and_saved_flags() -> None:
    history = CudaAllocatorHistory(torch.device("cuda", 0))
    history.entries = [
        {
            "action": "alloc",
            "addr": 0x1000,
            "size": 512,
            "stream": 0,
        },  # before the first mark's count: prologue
        {"action": "alloc", "addr": 0x2000, "size": 1024, "stream": 0},  # block 1, forward
        {"action": "free_requested", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 2048, "stream": 0},  # address reused, block 1 backward
        {
            "action": "free_completed",
            "addr": 0x9999,
            "size": 4096,
            "stream": 0,
        },  # allocated before the window
    ]
    # (address, allocations so far) at pack time: 0x1000 saved after 2 allocations is the first one there
    history.saved = [(0x2000, 2), (0x1000, 2)]
    mark_counts = [0, 1, 2]  # allocations seen at each cursor mark
    mark_cursor: list[tuple[int | None, Phase]] = [
        (0, Phase.forward),
        (1, Phase.forward),
        (1, Phase.backward),
    ]

    records, next_event, by_addr = history.records(10, 5, mark_counts, mark_cursor)

    assert [r.sid for r in records] == [5, 6, 7]
    assert [r.nbytes for r in records] == [512, 1024, 2048]
    assert [(r.block, r.phase) for r in records] == [
        (0, Phase.forward),
        (1, Phase.forward),
        (1, Phase.backward),
    ]
    assert [r.alloc_event for r in records] == [10, 11, 13]
    assert records[0].free_event == 12 and records[1].free_event is None and records[2].free_event is None
    assert next_event == 14  # the free of a pre-window allocation is not an event of the window
    assert [r.saved_for_backward for r in records] == [True, True, False]
    assert by_addr[0x1000] == [(0, 5), (2, 7)]


def test_skip_actions_is_passed_only_to_a_pytorch_that_takes_it(monkeypatch) -> None:
    """Issue 19 defect 10: pyproject allows torch>=2.4, whose `_record_memory_history` has no `skip_actions`."""
    from agent.profiler import cuda_history

    assert cuda_history.record_history_takes_skip_actions()  # the installed torch (2.13) takes it

    def record_history_of_torch_2_4(enabled="all", context="all", stacks="all", max_entries=0, device=None):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_history_of_torch_2_4)
    assert not cuda_history.record_history_takes_skip_actions()


def test_segment_entries_recorded_by_an_older_pytorch_are_ignored() -> None:
    history = CudaAllocatorHistory(torch.device("cuda", 0))
    history.entries = [
        {"action": "segment_alloc", "addr": 0x0, "size": 2 << 20, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 512, "stream": 0},
        {"action": "segment_free", "addr": 0x0, "size": 2 << 20, "stream": 0},
    ]
    records, next_event, _ = history.records(0, 0, [0], [(0, Phase.forward)])
    assert [(r.nbytes, r.free_event) for r in records] == [(512, None)] and next_event == 1
