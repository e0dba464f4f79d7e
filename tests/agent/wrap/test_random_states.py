"""`agent.wrap` leaves every global random-number generator as it found it (session 22 probe).

Profiling runs the user's model several times; it kept torch's generators but drew from Python's `random` and
numpy's global generator unchecked. Wav2Vec2 at its library defaults draws its SpecAugment time masks from numpy
(`mask_time_prob=0.05`): after `transformers.set_seed(0)` and `agent.wrap`, training drew other masks than the
plain run after `set_seed(0)` (first loss 60.579 against 60.549).
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import transformers

import agent
from agent.random_states import RandomStates, kept_random_states
from agent.testing.loops import train_with_clipping

pytestmark = pytest.mark.slow


def wav2vec2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        ctc_loss_reduction="mean",
    )
    assert cfg.mask_time_prob > 0  # the library's default: SpecAugment masks drawn from numpy in training
    model = transformers.Wav2Vec2ForCTC(cfg)
    model.train()
    return model, {"input_values": torch.randn(2, 4000), "labels": torch.randint(1, 32, (2, 20))}


def draws() -> tuple[float, float, float]:
    return torch.rand(()).item(), random.random(), float(np.random.rand())


def test_wrap_leaves_torchs_pythons_and_numpys_generators_as_they_were() -> None:
    model, batch = wav2vec2()
    transformers.set_seed(0)
    expected = draws()
    transformers.set_seed(0)
    run = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters()),
        sample_batch=batch,
        device_memory=64 << 20,
        feedback_steps=None,
    )
    assert draws() == expected
    agent.unwrap(run)


def test_a_model_drawing_from_numpy_trains_as_the_plain_run_after_set_seed() -> None:
    model, batch = wav2vec2()
    reference = copy.deepcopy(model)
    transformers.set_seed(0)
    expected = train_with_clipping(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batch, steps=3, max_norm=0.5
    )

    transformers.set_seed(0)
    run = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sample_batch=batch,
        device_memory=64 << 20,
        feedback_steps=None,
    )
    got = train_with_clipping(run.model, run.optimizer, batch, steps=3, max_norm=0.5)
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    agent.unwrap(run)


def test_kept_random_states_restore_every_generator_after_an_error() -> None:
    transformers.set_seed(3)
    before = RandomStates.capture()
    expected = draws()
    before.restore()
    with pytest.raises(RuntimeError, match="boom"), kept_random_states():
        draws()
        raise RuntimeError("boom")
    assert draws() == expected
