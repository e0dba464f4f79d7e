"""Where the runtime is in the training iteration (FSDP2's `TrainingState`): idle, forward or backward."""

from __future__ import annotations

from enum import Enum


class TrainingState(Enum):
    """The runtime's phase: hooks behave differently in forward, in backward and between iterations."""

    IDLE = "idle"  # between iterations, or a forward without grad finished
    FORWARD = "forward"  # the wrapped model's forward runs
    BACKWARD = "backward"  # from the first gradient (or unpack) of a training forward to the end callback


class Phase:
    """The phase the runtime's parts share (the manager moves it; residency, gradients and saved-tensor
    rebinding read it)."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE

    @property
    def backward(self) -> bool:
        """Backward runs (recomputations inside it included)."""
        return self.state is TrainingState.BACKWARD

    @property
    def forward(self) -> bool:
        """The wrapped model's forward runs."""
        return self.state is TrainingState.FORWARD
