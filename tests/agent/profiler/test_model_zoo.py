"""Model zoo: each architecture builds from config with random weights and trains on a sample batch."""

from __future__ import annotations

import pytest
import torch

from agent.testing.model_zoo import KINDS, build, sample_batch


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_builds_and_gives_a_finite_loss_with_gradients(kind: str) -> None:
    model, config = build(kind, layers=2, hidden=64, vocab=200, seq=32)
    batch = sample_batch(config, batch=2, seq=16)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, 16)
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert config.num_hidden_layers == 2


def test_same_arguments_give_identical_weights() -> None:
    a, _ = build("llama", layers=1, hidden=32, vocab=100, seq=16)
    b, _ = build("llama", layers=1, hidden=32, vocab=100, seq=16)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb)


def test_unknown_kind_is_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kind: 'bert'"):
        build("bert", layers=1, hidden=32)


def test_heads_that_do_not_divide_hidden_are_rejected() -> None:
    with pytest.raises(ValueError, match="heads: 5"):
        build("gpt2", layers=1, hidden=64, heads=5)


def test_sample_longer_than_the_model_is_rejected() -> None:
    _, config = build("gpt2", layers=1, hidden=32, seq=16)
    with pytest.raises(ValueError, match="seq: 32"):
        sample_batch(config, batch=1, seq=32)
