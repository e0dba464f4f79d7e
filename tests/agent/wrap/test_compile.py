"""torch.compile after `agent.wrap` (issue 16, defect 6): the runtime's hooks run eagerly between compiled
regions (agent/runtime/eager.py), so compiling each block (the FSDP2 habit), the wrapped model, or
`wrapped.model.compile()` trains exactly as plain PyTorch, with no recompilation from step to step.

A Hugging Face llama built from config at library defaults (use_cache, SDPA, tied embeddings as the
library sets them), random weights, CPU; the real profiler and solver; a device limit that offloads every
chunk. The fast cases use `backend="aot_eager"` (AOTAutograd as inductor runs it, without code generation);
one inductor case is marked slow (about 30 s here).
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from client.contract import ActivationMode, Plan

STEPS = 4
TOL = 1e-5
MAX_GRAD_NORM = 1.0
LIMIT_FRACTION = 0.7  # of the un-managed peak: the model states no longer fit, chunks are offloaded


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(
    model: Callable[..., Any],
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    *,
    compiled: bool = False,
) -> list[float]:
    """`compiled`: the steps after the first reuse the first step's graphs (a recompilation raises)."""
    torch.manual_seed(0)
    losses = []
    for step in range(STEPS):
        with torch._dynamo.config.patch(error_on_recompile=compiled and step > 0):
            loss = model(**batch).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class Setup:
    def __init__(self) -> None:
        import agent

        self.model, config = build_with_library_defaults("llama", layers=2, hidden=128, vocab=2048, seq=64)
        assert self.model.config.use_cache is True  # library defaults are the point
        self.batch = sample_batch(config, 2, 32)
        reference = copy.deepcopy(self.model)
        self.expected = train(reference, list(reference.parameters()), adamw(reference), self.batch)
        probe = copy.deepcopy(self.model)
        self.peak = agent.profile(
            probe, self.batch, optimizer=adamw(probe), repeats=1, allocation_trace=False
        ).measurements.peak_device_bytes
        self._plan: Plan | None = None

    def wrap_solved(self) -> Any:
        """The user's path: `agent.wrap` profiles and solves under a limit that offloads."""
        import agent

        model = copy.deepcopy(self.model)
        wrapped = agent.wrap(
            model,
            adamw(model),
            sample_batch=self.batch,
            device_memory=int(self.peak * LIMIT_FRACTION),
            feedback_steps=None,
        )
        assert wrapped.plan.policy is not None
        assert all(c.placement.value == "offloaded" for c in wrapped.plan.policy.chunks), wrapped.plan.policy
        self._plan = wrapped.plan
        return wrapped

    def wrap_with_modes(self, modes: dict[str, ActivationMode]) -> Any:
        """The solved plan again (no second profile), with the named blocks' activation modes replaced."""
        import agent

        if self._plan is None:
            agent.unwrap(self.wrap_solved())
        assert self._plan is not None and self._plan.policy is not None
        policy = self._plan.policy
        blocks = [b.model_copy(update={"mode": modes.get(b.module, b.mode)}) for b in policy.blocks]
        assert {b.module for b in blocks} >= set(modes), [b.module for b in blocks]
        plan = self._plan.model_copy(update={"policy": policy.model_copy(update={"blocks": blocks})})
        model = copy.deepcopy(self.model)
        return agent.wrap(model, adamw(model), plan=plan, feedback_steps=None)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def check_losses(got: list[float], expected: list[float]) -> None:
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs plain PyTorch {b}"


def memplan_code() -> dict[str, types.CodeType]:
    """Every code object (nested functions too) of the agent modules that register hooks on the model."""
    import agent.allocator.cuda
    import agent.batch_guard
    import agent.feedback
    import agent.runtime.activations
    import agent.runtime.chunks
    import agent.runtime.gradients
    import agent.runtime.host_steps
    import agent.runtime.manager
    import agent.runtime.residency
    import agent.runtime.saved_tensors
    import agent.runtime.swap

    found: dict[str, types.CodeType] = {}

    def add(code: types.CodeType) -> None:
        found[f"{code.co_filename}:{code.co_firstlineno} {code.co_qualname}"] = code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add(const)

    for module in (
        agent.runtime.manager,
        agent.runtime.gradients,
        agent.runtime.residency,
        agent.runtime.saved_tensors,
        agent.runtime.host_steps,
        agent.runtime.activations,
        agent.runtime.swap,
        agent.runtime.chunks,
        agent.batch_guard,
        agent.feedback,
        agent.allocator.cuda,
    ):
        for _, obj in inspect.getmembers(module):
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                for _, fn in inspect.getmembers(obj, inspect.isfunction):
                    add(fn.__code__)
            elif inspect.isfunction(obj) and obj.__module__ == module.__name__:
                add(obj.__code__)
    return found


def check_compiled_without_recompiles() -> None:
    """Something was compiled, no frame of memplan's hooks was ever traced (before: each was, and recompiled
    at every call up to the recompile limit), and train(compiled=True) raised on any later recompilation."""
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    code = memplan_code()
    assert len(code) > 50
    traced = [name for name, c in code.items() if _debug_get_cache_entry_list(c)]
    assert not traced, f"torch.compile traced memplan's hooks: {traced}"


def compile_blocks(model: nn.Module, backend: str) -> None:
    for block in model.model.layers:
        block.compile(backend=backend)


def test_compiling_each_block_after_wrap_trains_like_plain_pytorch(setup: Setup) -> None:
    """Before: the runtime's hooks were traced into the blocks' graphs (inductor: `set_` on a graph input;
    aot_eager: a recompilation at every call until the recompile limit)."""
    import agent

    wrapped = setup.wrap_solved()
    compile_blocks(wrapped.model, "aot_eager")
    got = train(
        wrapped.model, list(wrapped.model.parameters()), wrapped.optimizer, setup.batch, compiled=True
    )
    check_losses(got, setup.expected)
    check_compiled_without_recompiles()
    assert wrapped.runtime.counters.demand_uploads > 0  # offloaded chunks were uploaded by the eager hooks
    agent.unwrap(wrapped)


@pytest.mark.parametrize(
    "how", ["torch.compile(model)", pytest.param("model.compile()", marks=pytest.mark.slow)]
)
def test_compiling_the_whole_wrapped_model_trains_like_plain_pytorch(setup: Setup, how: str) -> None:
    import agent

    wrapped = setup.wrap_with_modes({})
    model: Callable[..., Any] = wrapped.model
    if how == "torch.compile(model)":
        model = torch.compile(wrapped.model, backend="aot_eager")
    else:
        wrapped.model.compile(backend="aot_eager")
    got = train(model, list(wrapped.model.parameters()), wrapped.optimizer, setup.batch, compiled=True)
    check_losses(got, setup.expected)
    check_compiled_without_recompiles()
    agent.unwrap(wrapped)


@pytest.mark.parametrize(
    "first,second",
    [
        (ActivationMode.swap, ActivationMode.checkpoint),
        pytest.param(ActivationMode.checkpoint, ActivationMode.swap, marks=pytest.mark.slow),
    ],
)
def test_compiled_blocks_with_swapped_and_checkpointed_activations_train_like_plain_pytorch(
    setup: Setup, first: ActivationMode, second: ActivationMode
) -> None:
    """A swapped block's own forward is compiled inside the swap's saved-tensor hooks; a checkpointed block
    runs eagerly (docs/architecture/wrap.md)."""
    import agent

    wrapped = setup.wrap_with_modes({"model.layers.0": first, "model.layers.1": second})
    assert wrapped.activations.mode_strip() == "".join(m.value[0].upper() for m in (first, second))
    compile_blocks(wrapped.model, "aot_eager")
    got = train(
        wrapped.model, list(wrapped.model.parameters()), wrapped.optimizer, setup.batch, compiled=True
    )
    check_losses(got, setup.expected)
    check_compiled_without_recompiles()
    counters = wrapped.activations.counters
    assert counters.swapped_forwards == STEPS and counters.checkpointed_forwards == STEPS, counters
    agent.unwrap(wrapped)


def test_fullgraph_compile_of_a_wrapped_block_fails_naming_what_works(setup: Setup) -> None:
    """fullgraph=True cannot hold the runtime's eager hooks: dynamo's error says why and what works."""
    import agent

    wrapped = setup.wrap_with_modes({})
    for block in wrapped.model.model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(
        torch._dynamo.exc.Unsupported,
        match=r"memplan's runtime hook.*compile a wrapped model or its blocks without fullgraph=True",
    ):
        wrapped.model(**setup.batch)
    agent.unwrap(wrapped)


@pytest.mark.slow
def test_inductor_compiled_blocks_after_wrap_train_like_plain_pytorch(setup: Setup) -> None:
    """The issue's failure: inductor rejected `set_` on a graph input. About 30 s on 2 CPU cores."""
    import agent

    wrapped = setup.wrap_with_modes({})
    compile_blocks(wrapped.model, "inductor")
    got = train(
        wrapped.model, list(wrapped.model.parameters()), wrapped.optimizer, setup.batch, compiled=True
    )
    check_losses(got, setup.expected)
    check_compiled_without_recompiles()
    agent.unwrap(wrapped)


def test_zero_grad_of_the_compiled_model_starts_fresh_gradients(setup: Setup) -> None:
    """Defect found here: `torch.compile(wrapped.model).zero_grad()` (what Trainer calls with
    `torch_compile=True`) is `nn.Module.zero_grad`, which sets every `.grad` to None without the runtime's
    `zero_grad`: the next backward added to the offloaded chunks' old host gradients (silently wrong
    training). A `.grad` set to None now means a fresh gradient, as in torch."""
    import agent

    wrapped = setup.wrap_with_modes({})
    compiled = torch.compile(wrapped.model, backend="aot_eager")
    params = list(wrapped.model.parameters())
    torch.manual_seed(0)
    got = []
    for _ in range(STEPS):
        loss = compiled(**setup.batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        wrapped.optimizer.step()
        torch.nn.Module.zero_grad(compiled)  # what OptimizedModule.zero_grad is; the runtime's is not called
        got.append(loss.item())
    check_losses(got, setup.expected)
    agent.unwrap(wrapped)


def test_grads_set_to_none_by_hand_start_fresh_gradients(setup: Setup) -> None:
    """The same without compile: `p.grad = None` for every parameter instead of `zero_grad()`."""
    import agent

    wrapped = setup.wrap_with_modes({})
    params = list(wrapped.model.parameters())
    torch.manual_seed(0)
    got = []
    for _ in range(STEPS):
        loss = wrapped.model(**setup.batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        wrapped.optimizer.step()
        for p in params:
            p.grad = None
        got.append(loss.item())
    check_losses(got, setup.expected)
    agent.unwrap(wrapped)


@pytest.mark.slow
def test_trainer_with_torch_compile_trains_like_plain_trainer(tmp_path: Any) -> None:
    """`TrainingArguments(torch_compile=True)` after `wrap_trainer`: Accelerate compiles the wrapped model
    and the Trainer calls the compiled module's `zero_grad()` (the defect above: gradients accumulated)."""
    import transformers

    from agent.integrations.hf import wrap_trainer

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]

    def run(compiled: bool, wrapped: bool) -> list[tuple[float, float]]:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=4,
            learning_rate=2e-3,
            logging_steps=1,
            save_strategy="no",
            max_grad_norm=0.5,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=7,
            dataloader_num_workers=0,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        if wrapped:
            w = wrap_trainer(trainer, device_memory=int(4.6e6))
            assert w.plan.policy is not None
            assert all(c.placement.value == "offloaded" for c in w.plan.policy.chunks)
        trainer.train()
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]

    expected = run(compiled=False, wrapped=False)
    torch._dynamo.reset()
    got = run(compiled=True, wrapped=True)
    assert len(got) == len(expected) == 4
    for step, ((loss, norm), (loss0, norm0)) in enumerate(zip(got, expected, strict=True)):
        assert abs(loss - loss0) <= TOL * abs(loss0), f"step {step}: loss {loss} vs plain Trainer {loss0}"
        assert abs(norm - norm0) <= TOL * abs(norm0), (
            f"step {step}: grad_norm {norm} vs plain Trainer {norm0}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gemma2", "falcon", "mixtral", "phi3"])
def test_compiled_families_at_library_defaults_train_like_plain_pytorch(family: str) -> None:
    """`torch.compile(wrapped.model)` on other families (Conv1D and dropout, soft-capping, MoE routing)."""
    import agent

    model, config = build_with_library_defaults(family, layers=2, hidden=128, vocab=2048, seq=64)
    batch = sample_batch(config, 2, 32)
    reference = copy.deepcopy(model)
    expected = train(reference, list(reference.parameters()), adamw(reference), batch)
    probe = copy.deepcopy(model)
    peak = agent.profile(
        probe, batch, optimizer=adamw(probe), repeats=1, allocation_trace=False
    ).measurements.peak_device_bytes
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=batch, device_memory=int(peak * LIMIT_FRACTION), feedback_steps=None
    )
    assert wrapped.plan.policy is not None
    assert any(c.placement.value == "offloaded" for c in wrapped.plan.policy.chunks), wrapped.plan.policy
    got = train(
        torch.compile(wrapped.model, backend="aot_eager"),
        list(wrapped.model.parameters()),
        wrapped.optimizer,
        batch,
        compiled=True,
    )
    check_losses(got, expected)
    check_compiled_without_recompiles()
    agent.unwrap(wrapped)
