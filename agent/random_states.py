"""Every global random-number generator a training job draws from, kept across work memplan does for it.

Profiling, the managed-allocation trace and the integrations' sample-batch draw run the user's model and data
pipeline where the user's training would not; whatever they draw must not shift the draws the training makes
afterwards. torch's CPU and CUDA generators were kept from the start; Python's `random` and numpy's global
generator were not (session 22): a Wav2Vec2 model draws its SpecAugment time masks from numpy's, data
augmentations from either, and `transformers.set_seed` seeds all three, so after `agent.wrap` the masks of a
run differed from the plain run's (its first loss 60.579 against 60.549).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RandomStates:
    """The states of torch's CPU generator, every initialised CUDA device's, Python's `random` and numpy's."""

    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: tuple[Any, ...]
    numpy: dict[str, Any]

    @classmethod
    def capture(cls) -> RandomStates:
        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        return cls(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state(legacy=False))

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextmanager
def kept_random_states() -> Iterator[None]:
    """Every generator's state on exit (error or not) as it was on entry."""
    states = RandomStates.capture()
    try:
        yield
    finally:
        states.restore()
