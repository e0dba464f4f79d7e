"""`wrap(...).report()` reads as English: counts agree with their nouns, the plan's origin is said once."""

from __future__ import annotations

import dataclasses

import torch

from agent.runtime import manual_plan
from agent.testing.model_zoo import build, sample_batch
from agent.wrapping import unwrap, wrap


def test_report_says_one_buffer_and_names_the_origin_once() -> None:
    model, cfg = build("gpt2", layers=2, hidden=64, vocab=128, seq=32, seed=0)
    w = wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        plan=manual_plan(model, chunk_size_bytes=2**20),
        feedback_steps=None,
    )
    batch = sample_batch(cfg, 2, 32)
    w.model(**batch).loss.backward()
    w.optimizer.step()
    rep = w.report()
    unwrap(w)
    one = dataclasses.replace(
        rep,
        chunks=1,
        offloaded_chunks=1,
        n_buffers=1,
        origin="embedded",
        message="solved in-process (embedded)",
        runtime=dataclasses.replace(rep.runtime, n_buffers=1),
    )
    text = str(one)
    assert "1 chunk, 1 offloaded, 1 device buffer for offloaded chunks" in text, text
    assert "1 buffer of" in text and "1 buffers" not in text and "1 chunks" not in text, text
    assert text.startswith("plan: solved in-process (embedded); solver"), text  # not "(embedded) [embedded]"
    two = str(
        dataclasses.replace(one, chunks=2, n_buffers=2, origin="service", message="plan abc from http://x")
    )
    assert (
        "2 chunks, 1 offloaded, 2 device buffers" in two and "plan: plan abc from http://x [service];" in two
    )
