"""Integrations with training frameworks: Hugging Face Trainer (`hf.wrap_trainer`); Accelerate needs none
(wrap first, then `accelerator.prepare(wrapped.model, wrapped.optimizer, ...)`: see `hf.py`)."""
