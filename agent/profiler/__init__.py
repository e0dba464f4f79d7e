"""Agent profiler: measure a real training iteration and return a wire-contract Trace (`profile`)."""

from agent.profiler.block_detection import BlockDetectionError
from agent.profiler.profiling import profile
from agent.profiler.session import ProfilerInputError

__all__ = ["profile", "BlockDetectionError", "ProfilerInputError"]
