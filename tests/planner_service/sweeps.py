"""What the sweep tests share (whatif/test_sweeps.py through the API, SDK and CLI; ui/test_sweep_page.py
through the pages): the small Llama they sweep. Its service fixture, `sweep_service`, is in this folder's
conftest.py."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

# 2 layers, 64 wide: every point's plan solves well within the sweeps' 1 s limit on the 2 workers
TINY_LLAMA: dict[str, object] = transformers.AutoConfig.for_model(
    "llama",
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=256,
).to_dict()
