"""A Hugging Face checkpoint saved mid-training under `agent.wrap` is the user's model: its config keeps the
user's `use_cache` (the runtime turns the KV cache off while training), its weights are the trained ones, and
training goes on as before the save.

Defect (session 32): `wrapped.model.save_pretrained(d)` (what the Trainer's checkpoints call) wrote
`use_cache: false` into config.json and generation_config.json, so a model loaded from the checkpoint
generated without a KV cache.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_a_checkpoint_saved_while_training_keeps_the_users_kv_cache_setting_and_the_trained_weights(
    tmp_path: Path,
) -> None:
    import transformers

    import agent
    from agent.testing.plans import offloaded_plan

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    batch = sample_batch(config, 2, 32)
    assert model.config.use_cache is True and model.generation_config.use_cache is True
    reference = copy.deepcopy(model)
    ref_opt = adamw(reference)
    # chunks offloaded and blocks checkpointed: the runtime re-runs blocks in backward (why the cache is off)
    wrapped = agent.wrap(
        model, adamw(model), plan=offloaded_plan(model, batch, "CC"), sample_batch=batch, feedback_steps=None
    )
    losses = [step(wrapped.model, wrapped.optimizer, batch) for _ in range(2)]
    expected = [step(reference, ref_opt, batch) for _ in range(2)]
    assert model.config.use_cache is False  # off while training

    wrapped.model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
    assert json.loads((tmp_path / "generation_config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False and model.generation_config.use_cache is False  # off again
    pickle.dumps(model.config)  # nothing unpicklable was left on the config (torch.save(model) pickles it)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.use_cache is True
    trained = reference.state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6, msg=name)

    # training goes on as the plain model's does
    losses.append(step(wrapped.model, wrapped.optimizer, batch))
    expected.append(step(reference, ref_opt, batch))
    assert losses == pytest.approx(expected, rel=1e-5)
    agent.unwrap(wrapped)
    assert model.config.use_cache is True and model.generation_config.use_cache is True
