"""Models users fine-tune for other tasks, at their library defaults (session 21 probe): T5 and BART
(encoder-decoder, `labels` shifted into decoder inputs by the library), Whisper (speech features in, text out)
and ViT (image classification). Every chunk offloaded, the repeated blocks kept, checkpointed and swapped in
turn, gradient clipping: the losses equal plain PyTorch's within 1e-5 (fp32, dropout seeded alike). No defect was
found; this keeps it so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import transformers

import agent
from agent.testing.loops import train_with_clipping
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

TOL = 1e-5
Job = tuple[torch.nn.Module, dict[str, torch.Tensor]]


def t5() -> Job:
    cfg = transformers.T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(cfg), {
        "input_ids": torch.randint(0, 256, (2, 24)),
        "labels": torch.randint(0, 256, (2, 16)),
    }


def bart() -> Job:
    cfg = transformers.BartConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    return transformers.BartForConditionalGeneration(cfg), {
        "input_ids": torch.randint(3, 256, (2, 24)),
        "labels": torch.randint(3, 256, (2, 16)),
    }


def whisper() -> Job:
    cfg = transformers.WhisperConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(2, 16, 64),
        "labels": torch.randint(3, 256, (2, 12)),
    }


def vit() -> Job:
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    return transformers.ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(4, 3, 32, 32),
        "labels": torch.randint(0, 10, (4,)),
    }


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    return train_with_clipping(model, opt, batch, steps=3, max_norm=0.5)  # (seeded: the same dropout masks)


@pytest.mark.parametrize("make", [t5, bart, whisper, vit], ids=["t5", "bart", "whisper", "vit"])
def test_other_task_models_train_like_plain_pytorch(make: Callable[[], Job]) -> None:
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    reference = copy.deepcopy(model)
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batch)

    m = copy.deepcopy(model)
    run = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-2),
        plan=offloaded_plan(model, batch),  # keep, checkpoint and swap in turn
        feedback_steps=None,
    )
    got = train(run.model, run.optimizer, batch)
    assert run.runtime.counters.uploads > 0
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= TOL * abs(b), (run.plan.policy.mode_strip(), got, expected)
