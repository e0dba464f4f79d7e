"""Measured memory agrees with an independent tracker (torch's MemTracker) over an un-hooked step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from agent.profiler import profile
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware, Trace


def _independent_peak(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Peak bytes of one steady-state AdamW step, tracked by torch.distributed._tools.mem_tracker."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    step()  # optimizer state exists from here on: steady state, like the profiler's tracked iteration
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _model_state_bytes(trace: Trace) -> int:
    w = trace.workload
    params = sum(p.bytes for p in trace.model.parameters)
    elements = sum(p.numel for p in trace.model.parameters)
    return params + elements * (w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt_neox"])
def test_activations_plus_model_state_is_within_10_percent_of_the_independent_peak(
    kind: str, cpu_hardware: Hardware
) -> None:
    model, config = build(kind, layers=4, hidden=128, vocab=1000, seq=128)
    batch = sample_batch(config, 4, 128)
    trace = profile(model, batch, hardware=cpu_hardware, repeats=1)
    peak = _independent_peak(model, batch)

    activations = sum(b.activation_bytes for b in trace.measurements.blocks)
    estimate = activations + _model_state_bytes(trace)
    assert abs(estimate / peak - 1) <= 0.10, (estimate, peak)
    # The profiler's own peak (its storage tracker) is the same quantity measured a second way.
    assert abs(trace.measurements.peak_device_bytes / peak - 1) <= 0.01, (
        trace.measurements.peak_device_bytes,
        peak,
    )


def test_repeated_identical_blocks_save_identical_activation_bytes(cpu_hardware: Hardware) -> None:
    model, config = build("llama", layers=3, hidden=64, vocab=200, seq=32)
    trace = profile(model, sample_batch(config, 2, 32), hardware=cpu_hardware, repeats=1)
    blocks = trace.measurements.blocks[1:-1]
    # Tensors every block saves (rotary cos/sin) are counted once, in the first block that saves them.
    assert len({b.activation_bytes for b in blocks[1:]}) == 1
    assert blocks[0].activation_bytes >= blocks[1].activation_bytes > 0
    # A block's input is one hidden-state tensor of batch*seq*hidden fp32; the shared mask/rotary tensors
    # count once, in the first block.
    assert [b.input_bytes for b in blocks[1:]] == [2 * 32 * 64 * 4] * 2
    assert blocks[0].input_bytes > 2 * 32 * 64 * 4
    assert all(b.forward_s > 0 and b.backward_s > 0 and b.recompute_s > 0 for b in blocks)


class Doubled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2  # saves nothing for backward


class FreshInputs(torch.nn.Module):
    """Each block gets a fresh copy of the hidden state that nothing saves (as a cast or `.contiguous()` before
    each layer makes one): the copy is freed when the block returns, and the next block's copy is allocated
    at its address at once."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(Doubled(), torch.nn.Linear(width, width)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x.clone())
        return x.square().mean()


def test_a_block_input_at_a_freed_inputs_address_is_counted(cpu_hardware: Hardware) -> None:
    """Session 21: storages were told apart by address for the whole iteration, so a block input allocated
    where an earlier block's freed input had been counted 0 bytes (the what-if's fake run showed it about
    once in 20 runs). A storage's address now names it only while it is alive."""
    model = FreshInputs(4, 32)
    x = torch.randn(8, 32)
    trace = profile(model, x, loss_fn=lambda out, _batch: out, hardware=cpu_hardware, repeats=1)
    blocks = trace.measurements.blocks[1:-1]
    assert [b.input_bytes for b in blocks] == [8 * 32 * 4] * 4


def test_live_storage_keys_forget_a_storage_when_it_is_freed() -> None:
    from agent.profiler.tensors import LiveStorageKeys, storage_key

    keys = LiveStorageKeys()
    a = torch.empty(1024)
    view = a[1:]
    keys.add(view)
    key = storage_key(a)
    assert key in keys
    del a
    assert key in keys  # the view holds the storage
    del view
    assert key not in keys  # freed: its address may be the next storage's
    b = torch.empty(1024)
    keys.add(b)
    assert storage_key(b) in keys
    keys.clear()
    assert storage_key(b) not in keys and not keys.keys
