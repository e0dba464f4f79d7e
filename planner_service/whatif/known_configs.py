"""Published Hugging Face `config.json` objects the what-if tests and benchmarks ask about, defined once.

Each is the config as its model card's `config.json` reads (no weights): `memplan whatif --config` takes the
JSON of one written to a file, `POST /v1/whatif` takes the object.
"""

from __future__ import annotations

from typing import Any

# meta-llama/Llama-2-7b-hf config.json; 6,738,415,616 parameters.
LLAMA_2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}
