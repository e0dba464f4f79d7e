"""Build Hugging Face causal-LM architectures from config objects with random weights (nothing downloaded).

Used by `memplan profile`, tests and benchmarks across the project: every model here is a real
transformers model class (`GPT2LMHeadModel`, `LlamaForCausalLM`, ...) initialised from a config, so the
profiler and runtime see the same module tree, parameter names and kernels as a pretrained checkpoint of
that family would give, without any network access.

`transformers` is an optional dependency (`pip install memplan[models]`) that every function here needs, so
it is imported at the top: `import agent` and the agent's product path never import this module, and
`memplan profile`/`memplan demo` import it only when they run.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

KINDS: Final[tuple[str, ...]] = ("gpt2", "llama", "mistral", "qwen2", "gpt_neox")
"""Architectures `build` knows, by their Hugging Face `model_type`."""

DEFAULT_VOCAB: Final = 1000
DEFAULT_SEQ: Final = 128


def _heads_for(hidden: int) -> int:
    """A head count that divides `hidden`, aiming at a head dimension of 64 (at least 1 head)."""
    heads = max(1, hidden // 64)
    while hidden % heads:
        heads -= 1
    return heads


def make_config(
    kind: str,
    layers: int,
    hidden: int,
    heads: int | None = None,
    vocab: int = DEFAULT_VOCAB,
    seq: int = DEFAULT_SEQ,
) -> PretrainedConfig:
    """The transformers config of a `kind` model with `layers` blocks of width `hidden` (no weights)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    if layers < 1:
        raise ValueError(f"layers: must be at least 1, got {layers}")
    if hidden < 1:
        raise ValueError(f"hidden: must be at least 1, got {hidden}")
    if vocab < 2:
        raise ValueError(f"vocab: must be at least 2, got {vocab}")
    if seq < 1:
        raise ValueError(f"seq: must be at least 1, got {seq}")
    n_heads = heads if heads is not None else _heads_for(hidden)
    if n_heads < 1 or hidden % n_heads:
        raise ValueError(f"heads: {n_heads} must be at least 1 and divide hidden={hidden}")

    # No KV cache in training; special tokens inside the (usually small) vocabulary.
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "use_cache": False,
        "bos_token_id": 0,
        "eos_token_id": vocab - 1,
    }
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=n_heads, n_positions=seq, **common
        )
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            num_attention_heads=n_heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=seq,
            **common,
        )
    # Llama-family: SwiGLU MLP of width ~8/3 h rounded to a multiple of 16, RMSNorm, rotary positions.
    intermediate = max(16, (8 * hidden // 3 + 15) // 16 * 16)
    llama_like: dict[str, Any] = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": seq,
        **common,
    }
    if kind == "llama":
        return transformers.LlamaConfig(**llama_like)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=None, **llama_like)
    return transformers.Qwen2Config(**llama_like)


def build(
    kind: str,
    layers: int,
    hidden: int,
    heads: int | None = None,
    vocab: int = DEFAULT_VOCAB,
    seq: int = DEFAULT_SEQ,
    *,
    seed: int = 0,
) -> tuple[PreTrainedModel, PretrainedConfig]:
    """A randomly initialised causal LM of `kind` (see `KINDS`) and its config, in training mode on CPU.

    `heads` defaults to `hidden // 64` (rounded down to a divisor of `hidden`); `seq` is the longest
    sequence the model accepts. Weights come from `torch.manual_seed(seed)`, so equal arguments give an
    equal model.
    """
    config = make_config(kind, layers, hidden, heads, vocab, seq)
    # Eager attention: the same kernels on every machine, and a module tree without SDPA dispatch surprises.
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model, config


def sample_batch(
    config: PretrainedConfig, batch: int, seq: int, *, device: torch.device | str | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random batch `{"input_ids", "labels"}` of shape (batch, seq) for a model built from `config`.

    Labels equal the inputs (Hugging Face causal LMs shift them internally), so `model(**batch).loss` is
    the usual next-token loss.
    """
    if batch < 1:
        raise ValueError(f"batch: must be at least 1, got {batch}")
    if seq < 1:
        raise ValueError(f"seq: must be at least 1, got {seq}")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq > limit:
        raise ValueError(f"seq: {seq} is longer than the model's {limit} positions")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(config.vocab_size), (batch, seq), generator=generator)
    if device is not None:
        ids = ids.to(device)
    return {"input_ids": ids, "labels": ids.clone()}


# --------------------------------------------------------------------------- families at library defaults
DEFAULTS_FAMILIES: Final[tuple[str, ...]] = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "falcon",
    "phi",
    "phi3",
    "gpt_neox",
    "opt",
    "bloom",
    "olmo",
    "olmo2",
    "stablelm",
    "starcoder2",
    "granite",
    "gptj",
    "mixtral",
    "qwen2_moe",
    "gemma3_text",
    "cohere",
    "gpt_bigcode",
)
"""Families `build_with_library_defaults` knows (Hugging Face `model_type`s)."""


def library_default_config(
    family: str, layers: int = 2, hidden: int = 64, vocab: int = 128, seq: int = 64
) -> PretrainedConfig:
    """A config of `family` as its library makes it: only the sizes are set (layers, width, 2 heads, vocabulary,
    positions) and the special token ids moved inside the small vocabulary. `use_cache`, the attention
    implementation and `tie_word_embeddings` keep the library's defaults (unlike `make_config`/`build`,
    which turn the cache off and pick eager attention). This is what a user's `from_pretrained` model looks
    like, at toy size."""
    if family not in DEFAULTS_FAMILIES:
        raise ValueError(f"family: {family!r} is not one of {', '.join(DEFAULTS_FAMILIES)}")
    heads = 2
    tokens: dict[str, Any] = {
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": vocab - 1,
        "pad_token_id": 1,
    }
    llama_like: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": seq,
        **tokens,
    }
    head_dim: dict[str, Any] = {"head_dim": hidden // heads}
    makers: dict[str, Any] = {
        "gpt2": lambda: transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, **tokens
        ),
        "gptj": lambda: transformers.GPTJConfig(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=seq,
            rotary_dim=hidden // heads // 2,
            **tokens,
        ),
        "llama": lambda: transformers.LlamaConfig(**llama_like),
        "mistral": lambda: transformers.MistralConfig(**llama_like),
        "qwen2": lambda: transformers.Qwen2Config(**llama_like),
        "qwen3": lambda: transformers.Qwen3Config(**llama_like, **head_dim),
        "gemma": lambda: transformers.GemmaConfig(**llama_like, **head_dim),
        "gemma2": lambda: transformers.Gemma2Config(**llama_like, **head_dim),
        "phi": lambda: transformers.PhiConfig(**llama_like),
        "phi3": lambda: transformers.Phi3Config(**llama_like),
        "olmo": lambda: transformers.OlmoConfig(**llama_like),
        "olmo2": lambda: transformers.Olmo2Config(**llama_like),
        "stablelm": lambda: transformers.StableLmConfig(**llama_like),
        "starcoder2": lambda: transformers.Starcoder2Config(**llama_like),
        "granite": lambda: transformers.GraniteConfig(**llama_like),
        "falcon": lambda: transformers.FalconConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, **tokens
        ),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=seq,
            **tokens,
        ),
        "opt": lambda: transformers.OPTConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_dim=2 * hidden,
            max_position_embeddings=seq,
            word_embed_proj_dim=hidden,
            **tokens,
        ),
        "bloom": lambda: transformers.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, **tokens),
        "mixtral": lambda: transformers.MixtralConfig(
            **llama_like, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **llama_like,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2,
        ),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**llama_like, **head_dim),
        "cohere": lambda: transformers.CohereConfig(**llama_like),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, **tokens
        ),
    }
    return makers[family]()


def build_with_library_defaults(
    family: str, layers: int = 2, hidden: int = 64, vocab: int = 128, seq: int = 64, *, seed: int = 0
) -> tuple[PreTrainedModel, PretrainedConfig]:
    """`AutoModelForCausalLM.from_config(library_default_config(...))` with `torch.manual_seed(seed)`, in
    training mode on CPU: random weights, the library's defaults (KV cache on, SDPA or the family's own
    attention, tied embeddings where the family ties them)."""
    config = library_default_config(family, layers, hidden, vocab, seq)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model, config
