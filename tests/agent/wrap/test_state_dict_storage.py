"""`wrapped.model.state_dict()` saves as a plain model's does, through every saver users call: each value owns its
storage (tied names share one), so safetensors, Accelerate and `torch.save` write every tensor, and only it.

Defect (session 33): the values were views of the runtime's flat chunk buffers (a chunk's host copy, or its
device buffer), each carrying the whole chunk's storage. `safetensors.torch.save_model(wrapped.model, f)` raised
"None is covering the entire storage"; Accelerate's `save_model` (and `save_state`) kept one tensor per storage
as if the rest were tied, writing 6 of a llama-4L's 39 weights with a warning only; `torch.save` of a LoRA
adapter's state dict wrote 2.4 MB for its 64 kB.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow


def _trained(kind: str, modes: str) -> tuple[nn.Module, Any]:
    """A reference model and a wrapped copy, one identical step each (chunks offloaded by `offloaded_plan`)."""
    model, config = build_with_library_defaults(kind, layers=2, hidden=64, vocab=256, seq=64)
    batch = sample_batch(config, 2, 32)
    reference = copy.deepcopy(model)
    wrapped = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        plan=offloaded_plan(model, batch, modes),
        sample_batch=batch,
        feedback_steps=None,
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for m, opt in ((reference, ref_opt), (wrapped.model, wrapped.optimizer)):
        torch.manual_seed(1)  # the same dropout masks (gpt2's library default is 0.1)
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return reference, wrapped


def _assert_same_weights(got: dict[str, torch.Tensor], reference: nn.Module) -> None:
    expected = reference.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_every_value_owns_its_storage_and_tied_names_share_one(kind: str) -> None:
    reference, wrapped = _trained(kind, "KC")
    state = wrapped.model.state_dict()
    _assert_same_weights(state, reference)
    for key, value in state.items():
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), key
    if kind == "gpt2":  # the tied embedding and head: one tensor, as in the plain model's dict
        assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    # the model still trains on its own parameters, not on the copies
    state["model.norm.weight" if kind == "llama" else "transformer.ln_f.weight"].add_(1.0)
    _assert_same_weights(wrapped.model.state_dict(), reference)


def test_safetensors_and_accelerate_save_every_weight_and_load_back(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from safetensors.torch import load_file, load_model, save_model

    reference, wrapped = _trained("llama", "KC")
    save_model(wrapped.model, str(tmp_path / "model.safetensors"))
    _assert_same_weights(load_file(str(tmp_path / "model.safetensors")), reference)
    Accelerator(cpu=True).save_model(wrapped.model, str(tmp_path / "acc"))
    _assert_same_weights(load_file(str(tmp_path / "acc" / "model.safetensors")), reference)
    # and back into the wrapped model, from a file of other values
    other = copy.deepcopy(reference)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    save_model(other, str(tmp_path / "other.safetensors"))
    load_model(wrapped.model, str(tmp_path / "other.safetensors"))
    _assert_same_weights(wrapped.model.state_dict(), other)


def test_saving_a_few_values_writes_their_bytes_not_their_chunks() -> None:
    _, wrapped = _trained("llama", "CC")
    state = wrapped.model.state_dict()
    norm = {k: v for k, v in state.items() if k.endswith("input_layernorm.weight")}
    buffer = io.BytesIO()
    torch.save(norm, buffer)
    values = sum(v.numel() * v.element_size() for v in norm.values())
    assert buffer.tell() < values + 4096  # the values and pickle's framing (before: ~0.5 MB of chunk each)


class _FullDevice(torch.Tensor):
    """A tensor whose copies fail as a full CUDA device's do (`torch.OutOfMemoryError`), except to the host."""

    def clone(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_a_value_the_device_has_no_room_to_copy_is_copied_to_the_host_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The CUDA path of `_private_copy`, checked on the CPU: a persistent chunk's copy that does not fit the device
    is made on the host (load_state_dict takes it as it is), and said once, not once per value."""
    import logging
    from types import SimpleNamespace

    from agent.runtime.manager import ModelStateManager

    manager = SimpleNamespace(_state_dict_on_host_warned=False)
    caplog.set_level(logging.WARNING, logger="agent")
    for key in ("a.weight", "b.weight"):
        value = torch.arange(6.0).as_subclass(_FullDevice)
        copy_ = ModelStateManager._private_copy(manager, key, value)  # type: ignore[arg-type]
        assert (
            copy_.device.type == "cpu"
        )  # the host (here the CPU is the device too: the warning says which path ran)
        assert copy_.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
        assert torch.equal(torch.Tensor(copy_), torch.arange(6.0))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'a.weight'" in said[0] and "on the host" in said[0], said
