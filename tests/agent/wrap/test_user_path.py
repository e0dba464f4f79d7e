"""What users do first with `agent`, each as they write it: the README's import, size strings, Trainer's
`model.to(device)`, a loaded checkpoint's optimizer state, `blocks=`, `nn.Sequential` blocks, torch.compile.

Real models (Hugging Face from config at library defaults, plain PyTorch), the real profiler and solver.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, dict[str, torch.Tensor], int]:
    """A llama at library defaults, its batch, and its un-managed peak (for limits that force offloading)."""
    import agent

    model, config = build_with_library_defaults("llama", layers=2, hidden=128, vocab=2048, seq=64)
    batch = sample_batch(config, 2, 32)
    probe = copy.deepcopy(model)
    peak = agent.profile(
        probe, batch, optimizer=adamw(probe), repeats=1, allocation_trace=False
    ).measurements.peak_device_bytes
    return model, batch, peak


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "before", ["", "import agent.wrapping", "from agent.wrapping import Wrapped", "import agent.profiler"]
)
def test_the_readme_import_gives_the_functions_whatever_was_imported_before(before: str) -> None:
    """Defect: `import agent; agent.wrap(...)` raised RecursionError, and once the submodule `agent.wrap`
    was imported, `agent.wrap` was that module ('module' object is not callable)."""
    proc = run_python(f"""
        {before}
        import agent
        for name in ("wrap", "unwrap", "profile"):
            f = getattr(agent, name)
            assert callable(f) and type(f).__name__ == "function", (name, f)
        print("ok", agent.wrap.__module__, agent.profile.__module__)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok agent.wrapping" in proc.stdout


def test_importing_agent_stays_cheap() -> None:
    proc = run_python("""
        import sys, agent
        assert "torch" not in sys.modules, "import agent loaded torch"
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_call_runs_in_a_fresh_process_on_a_library_default_model() -> None:
    """`import agent; agent.wrap(...); agent.unwrap(...)` end to end in a new interpreter, as the README does."""
    proc = run_python("""
        import torch, agent
        from agent.testing.model_zoo import build_with_library_defaults, sample_batch
        model, config = build_with_library_defaults("qwen2", layers=2, hidden=64, vocab=256, seq=64)
        batch = sample_batch(config, 2, 16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        wrapped = agent.wrap(model, optimizer, sample_batch=batch, device_memory="1GiB", feedback_steps=None)
        loss = wrapped.model(**batch).loss
        loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
        model = agent.unwrap(wrapped)
        assert model.config.use_cache is True
        print("ok", wrapped.source.origin)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok embedded" in proc.stdout


# ------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("1GiB", 2**30),
        ("2GB", 2 * 10**9),
        (3 * 10**9, 3 * 10**9),
        (80e9, 80 * 10**9),
        ("512MiB", 2**29),
        (np.int64(2**30), 2**30),  # a numpy integer (a size computed with numpy): refused before session 32
    ],
)
def test_size_arguments_take_the_cli_strings_ints_and_whole_floats(given: object, expected: int) -> None:
    from agent.model_guards import byte_size

    assert byte_size("device_memory", given) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("80 gigs", "device_memory: .*not a byte size"),
        (1.5, "device_memory: 1.5 is not a whole number"),
        (float("nan"), "device_memory: nan is not a whole"),
        (-5, "device_memory: must be positive"),
        ([80], "device_memory: expected bytes"),
        (True, "device_memory: expected bytes"),
        ("0GiB", "must be positive"),
        ("-5GiB", "device_memory: must be positive"),  # said "not a byte size" before session 32
    ],
)
def test_bad_sizes_are_refused_by_wrap_naming_the_argument_before_anything_runs(
    given: object, message: str
) -> None:
    import agent

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises((ValueError, TypeError), match=message):
        agent.wrap(model, adamw(model), sample_batch=torch.randn(2, 4), device_memory=given)
    with pytest.raises((ValueError, TypeError), match=message.replace("device_memory", "host_memory")):
        agent.wrap(model, adamw(model), sample_batch=torch.randn(2, 4), host_memory=given)


@pytest.mark.parametrize(
    ("argument", "given", "message"),
    [
        ("wait_s", -1, "wait_s: must be a finite number of seconds, at least 0, got -1"),
        ("wait_s", float("nan"), "wait_s: must be a finite number"),
        ("wait_s", "60", "wait_s: expected seconds"),
        ("service_budget_s", -0.5, "service_budget_s: must be a finite number"),
    ],
)
def test_bad_durations_are_refused_naming_the_argument(argument: str, given: object, message: str) -> None:
    """`wait_s=-1` was accepted silently (found by an exploratory run, session 32)."""
    import agent

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises((ValueError, TypeError), match=message):
        agent.wrap(model, adamw(model), sample_batch=torch.randn(2, 4), **{argument: given})


class NeverRun(nn.Sequential):
    """Raises when called: a check that fires after profiling would meet this instead."""

    def forward(self, *args: object) -> torch.Tensor:
        raise AssertionError("wrap profiled the model before checking its arguments")


def test_an_optimizer_over_another_models_parameters_is_refused_before_anything_runs() -> None:
    """Found by an exploratory run (session 32): the error came only after a whole profile, after a warning
    that the managed iteration could not be recorded."""
    import agent

    model, other = NeverRun(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4)
    optimizer = torch.optim.AdamW([*model.parameters(), *other.parameters()])
    with pytest.raises(
        ValueError, match=r"optimizer.param_groups\[0\].params\[4\]: is not a parameter of the wrapped"
    ):
        agent.wrap(model, optimizer, sample_batch=torch.randn(2, 4), device_memory="1GiB")


def test_wrap_takes_a_size_string(llama: tuple[nn.Module, dict[str, torch.Tensor], int]) -> None:
    import agent

    model, batch, peak = copy.deepcopy(llama[0]), llama[1], llama[2]
    wrapped = agent.wrap(
        model,
        adamw(model),
        sample_batch=batch,
        device_memory=f"{peak * 0.7 / 2**20:.0f}MiB",
        feedback_steps=None,
    )
    assert wrapped.plan.constraints.device_memory_bytes == round(float(f"{peak * 0.7 / 2**20:.0f}") * 2**20)
    agent.unwrap(wrapped)


# ------------------------------------------------------------------------------------------- .to()
def test_to_where_the_model_already_is_is_a_no_op_and_a_real_move_is_refused(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int],
) -> None:
    """Defect: `.to(dtype)` after wrap was accepted and silently undone. Trainer calls model.to(args.device)
    after the model is wrapped: that must keep working."""
    import agent
    from agent.model_guards import WrappedModelMoveError

    model, batch, peak = copy.deepcopy(llama[0]), llama[1], llama[2]
    reference = copy.deepcopy(model)
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=batch, device_memory=int(peak * 0.7), feedback_steps=None
    )
    assert wrapped.model.to("cpu") is wrapped.model
    assert wrapped.model.to(torch.device("cpu"), torch.float32) is wrapped.model
    assert wrapped.model.to(dtype=torch.float32) is wrapped.model
    with pytest.raises(WrappedModelMoveError, match=r"model.to\(torch.bfloat16\): the model is wrapped"):
        wrapped.model.to(torch.bfloat16)
    with pytest.raises(WrappedModelMoveError, match="wrapped by memplan"):
        wrapped.model.half()
    with pytest.raises(WrappedModelMoveError, match="wrapped by memplan"):
        wrapped.model.double()
    assert all(p.dtype == torch.float32 for p in wrapped.model.parameters())
    losses = []
    for _ in range(3):
        loss = wrapped.model(**batch).loss
        loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
        losses.append(loss.item())
    opt = adamw(reference)
    for i in range(3):
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - losses[i]) <= 1e-5 * abs(loss.item())
    agent.unwrap(wrapped)
    assert model.to(torch.float64) is model and next(model.parameters()).dtype == torch.float64  # plain again


# ------------------------------------------------------------------------------------------- replaced tensors
def test_a_parameter_tensor_replaced_after_wrap_is_refused_and_an_in_place_change_is_kept(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int],
) -> None:
    """Defect (session 22): `resize_token_embeddings` after wrap (it sets the embedding's `weight.data` to a
    larger tensor) and `p.data = w` were undone without a word at the chunk's next bind (the embedding stayed at
    its old size). Now the next forward raises naming the parameter; an in-place change is what works."""
    import agent
    from agent.runtime.manager import ParameterReplacedError

    model, batch, peak = copy.deepcopy(llama[0]), llama[1], llama[2]
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=batch, device_memory=int(peak * 0.7), feedback_steps=None
    )
    assert any(c.placement.value == "offloaded" for c in wrapped.plan.policy.chunks)  # type: ignore[union-attr]
    wrapped.model.resize_token_embeddings(wrapped.model.config.vocab_size + 8)
    with pytest.raises(ParameterReplacedError, match=r"model.embed_tokens.weight: its tensor was replaced"):
        wrapped.model(**batch)
    agent.unwrap(wrapped)

    model, reference = copy.deepcopy(llama[0]), copy.deepcopy(llama[0])
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=batch, device_memory=int(peak * 0.7), feedback_steps=None
    )
    head = wrapped.model.lm_head.weight
    head.data = torch.zeros_like(head)
    with pytest.raises(ParameterReplacedError, match=r"lm_head.weight: its tensor was replaced"):
        wrapped.model(**batch)
    agent.unwrap(wrapped)

    model = copy.deepcopy(llama[0])
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=batch, device_memory=int(peak * 0.7), feedback_steps=None
    )
    with torch.no_grad():
        wrapped.model.lm_head.weight.mul_(0.5)
        reference.lm_head.weight.mul_(0.5)
        assert torch.equal(wrapped.model(**batch).logits, reference(**batch).logits)
    agent.unwrap(wrapped)


# ------------------------------------------------------------------------------------------- checkpoint state
def test_wrap_never_mutates_optimizer_state_the_caller_still_holds(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int],
) -> None:
    """Defect: wrap changed, in place, optimizer-state tensors shared with a loaded checkpoint dict."""
    import agent

    model, batch, peak = copy.deepcopy(llama[0]), llama[1], llama[2]
    opt = adamw(model)
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint = {"optimizer": copy.deepcopy(opt.state_dict()), "model": copy.deepcopy(model.state_dict())}
    kept = copy.deepcopy(checkpoint)
    resumed, _ = build_with_library_defaults("llama", layers=2, hidden=128, vocab=2048, seq=64)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = adamw(resumed)
    resumed_opt.load_state_dict(checkpoint["optimizer"])  # shares tensors with checkpoint["optimizer"]
    wrapped = agent.wrap(
        resumed, resumed_opt, sample_batch=batch, device_memory=int(peak * 0.7), feedback_steps=None
    )
    for _ in range(2):
        wrapped.model(**batch).loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
    for pid, state in kept["optimizer"]["state"].items():
        for key, value in state.items():
            now = checkpoint["optimizer"]["state"][pid][key]
            assert torch.equal(now, value), f"checkpoint optimizer state[{pid}][{key!r}] was changed by wrap"
    for name, value in kept["model"].items():
        assert torch.equal(checkpoint["model"][name], value), (
            f"checkpoint model[{name!r}] was changed by wrap"
        )
    agent.unwrap(wrapped)


# ------------------------------------------------------------------------------------------- blocks
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class SequentialNet(nn.Module):
    """Blocks in an nn.Sequential (no ModuleList anywhere)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.trunk = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.trunk(self.inp(x))).pow(2).mean()


class NamedBlocks(nn.Module):
    """Blocks as separate attributes: nothing to detect, `blocks=` says which they are."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.first, self.second, self.third = Block(width), Block(width), Block(width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.third(self.second(self.first(self.inp(x))))).pow(2).mean()


def loss_of(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int = 3) -> list[float]:
    out = []
    for _ in range(steps):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("make", [SequentialNet, NamedBlocks])
def test_sequential_blocks_are_detected_and_blocks_argument_is_taken(make: type[nn.Module]) -> None:
    """Defect: BlockDetectionError advised `blocks=`, which wrap did not take; nn.Sequential blocks were not found."""
    import agent

    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, 16)
    reference = copy.deepcopy(model)
    expected = _train(reference, adamw(reference), x)
    blocks = [model.first, model.second, model.third] if isinstance(model, NamedBlocks) else None
    wrapped = agent.wrap(
        model, adamw(model), sample_batch=x, loss_fn=loss_of, blocks=blocks, feedback_steps=None
    )
    names = [b.module for b in wrapped.plan.policy.blocks][1:-1] if wrapped.plan.policy else []
    assert names == (["first", "second", "third"] if blocks else [f"trunk.{i}" for i in range(4)])
    got = _train(wrapped.model, wrapped.optimizer, x)
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    agent.unwrap(wrapped)


# ------------------------------------------------------------------------------------------- torch.compile
def test_a_compiled_model_or_block_is_refused_with_one_clear_error() -> None:
    """torch.compile before wrap failed deep inside; now one error says what works."""
    import agent
    from agent.model_guards import CompiledModelError

    model = SequentialNet()
    x = torch.randn(8, 16)
    with pytest.raises(
        CompiledModelError, match="model: is a torch.compile result.*wrap the uncompiled model"
    ):
        agent.wrap(torch.compile(model), adamw(model), sample_batch=x, loss_fn=loss_of)
    model.trunk[1].compile()
    with pytest.raises(CompiledModelError, match=r"model.trunk.1: was compiled in place"):
        agent.wrap(model, adamw(model), sample_batch=x, loss_fn=loss_of)


# ------------------------------------------------------------------------------------------- sparse gradients
def mean_square(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.square().mean()


class SparseEmbeddingNet(nn.Module):
    def __init__(self, sparse_module: type[nn.Module] = nn.Embedding) -> None:
        super().__init__()
        self.emb = sparse_module(50, 16, sparse=True)
        self.trunk = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = (
            self.emb(ids)
            if isinstance(self.emb, nn.Embedding)
            else self.emb(ids, torch.arange(0, ids.numel(), 4))
        )
        return self.trunk(x)


@pytest.mark.parametrize("sparse_module", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_with_sparse_gradients_is_refused_naming_it(sparse_module: type[nn.Module]) -> None:
    """`nn.Embedding(sparse=True)` failed deep inside the profiler ("Cannot access storage of SparseTensorImpl");
    now `wrap` names the module before anything runs, and `profile` names the parameter."""
    import agent
    from agent.profiler import ProfilerInputError

    model = SparseEmbeddingNet(sparse_module)
    ids = torch.randint(0, 50, (8,) if sparse_module is nn.EmbeddingBag else (4, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=rf"model.emb: {sparse_module.__name__}\(sparse=True\) gives sparse gradients"
    ):
        agent.wrap(model, opt, sample_batch=ids, loss_fn=mean_square)
    with pytest.raises(ProfilerInputError, match="parameter 'emb.weight' has a sparse gradient"):
        agent.profile(model, ids, loss_fn=mean_square, optimizer=opt)


def test_a_model_with_parameters_in_two_dtypes_is_refused_naming_them_and_trains_once_cast(
    tmp_path: Path,
) -> None:
    """Session 23: T5 loaded in fp16 (`from_pretrained(path, dtype=torch.float16)`, here from a checkpoint saved
    in this test) keeps its `_keep_in_fp32_modules` (`wo`) in fp32. `wrap` failed with a PlanMismatchError asking
    whether the plan was solved for another precision; now it names both dtypes, their first parameters and
    `_keep_in_fp32_modules`, before anything runs, and the model cast to one dtype trains."""
    import transformers

    import agent

    cfg = transformers.T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(tmp_path)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float16)
    model.train()
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 128, (2, 8), generator=g),
        "labels": torch.randint(0, 128, (2, 4), generator=g),
    }
    with pytest.raises(ValueError, match=r"several dtypes") as info:
        agent.wrap(model, torch.optim.AdamW(model.parameters()), sample_batch=batch, feedback_steps=None)
    said = str(info.value)
    assert "in float32 on cpu (first 'encoder.block.0.layer.1.DenseReluDense.wo.weight')" in said
    assert "_keep_in_fp32_modules ['wo']" in said and "in float16 on cpu" in said
    assert not getattr(model, "_memplan_wrapped", False) and not model._forward_hooks
    model.to(torch.bfloat16)
    wrapped = agent.wrap(
        model, torch.optim.AdamW(model.parameters()), sample_batch=batch, feedback_steps=None
    )
    wrapped.model(**batch).loss.backward()
    wrapped.optimizer.step()
    agent.unwrap(wrapped)


# ------------------------------------------------------------------------------------------- batch shapes
def test_a_larger_batch_than_planned_warns_once_and_max_batch_plans_for_it(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int], caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: dynamic padding / a longer eval batch silently exceeded the plan's limit (+78% measured)."""
    import logging

    import agent
    from agent.batch_guard import BatchShapeError, BatchShapeGuard

    model, batch = copy.deepcopy(llama[0]), llama[1]
    longer = {k: torch.cat([v, v], dim=1) for k, v in batch.items()}  # 2 x 64
    caplog.set_level(logging.WARNING, logger="agent")
    wrapped = agent.wrap(model, adamw(model), sample_batch=batch, device_memory="1GiB", feedback_steps=None)
    for b in (batch, longer, longer):
        wrapped.model(**b).loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
    said = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert said == [said[0]] and "batch of 2 x 64 (rows x sequence) is larger than the 2 x 32" in said[0]
    assert "max_batch" in said[0]
    agent.unwrap(wrapped)

    caplog.clear()
    planned = agent.wrap(
        model, adamw(model), sample_batch=batch, max_batch=longer, device_memory="1GiB", feedback_steps=None
    )
    assert planned.source.trace is not None and planned.source.trace.workload.sequence_length == 64
    planned.model(**longer).loss.backward()
    assert not [r for r in caplog.records if "larger than" in r.getMessage()]
    agent.unwrap(planned)

    # on a GPU the same batch is refused before the forward runs (checked here on the guard itself: no GPU)
    guard = BatchShapeGuard(nn.Linear(2, 2), (2, 32), torch.device("cuda", 0))
    with pytest.raises(BatchShapeError, match="refused before the forward"):
        guard._check(nn.Linear(2, 2), (), longer)
    # ... except an evaluation (no gradients, no activations kept), which warns: session 19 probe, a Trainer with a
    # larger eval batch stopped the training job at its first evaluation
    caplog.clear()
    with torch.no_grad():
        guard._check(nn.Linear(2, 2), (), longer)
    said = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert len(said) == 1 and "an evaluation without gradients" in said[0]


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_wrap_where_no_iteration_can_train_says_so(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int], context: str
) -> None:
    """Defect (session 33): `agent.wrap` under `torch.inference_mode()` raised a pydantic error about a copy
    bandwidth of 1e15 B/s (the hardware probe's second thread failed on inference tensors, its time stayed 0);
    under `torch.no_grad()` it said "loss_fn: must return a scalar tensor that requires grad" to a user who passed
    no loss_fn. Both now name the context, and the model is left unwrapped."""
    import agent
    from agent.profiler import ProfilerInputError

    model, batch = copy.deepcopy(llama[0]), llama[1]
    with (
        getattr(torch, context)(),
        pytest.raises(ProfilerInputError, match=f"called (under torch.{context}|with gradients disabled)"),
    ):
        agent.wrap(model, adamw(model), sample_batch=batch, device_memory="1GiB", feedback_steps=None)
    assert not getattr(model, "_memplan_wrapped", False)
    with getattr(torch, context)(), pytest.raises(ProfilerInputError, match=r"^profile: called "):
        agent.profile(model, batch, repeats=1, allocation_trace=False)


def test_a_model_with_every_parameter_frozen_is_refused_as_having_nothing_to_train(
    llama: tuple[nn.Module, dict[str, torch.Tensor], int],
) -> None:
    """Defect (session 33): every parameter frozen gave "loss_fn: must return a scalar tensor that requires grad"."""
    import agent
    from agent.profiler import ProfilerInputError

    model, batch = copy.deepcopy(llama[0]), llama[1]
    model.requires_grad_(False)
    with pytest.raises(ProfilerInputError, match="no parameter of LlamaForCausalLM requires grad"):
        agent.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()), repeats=1)


def test_runtime_options_are_where_the_readme_writes_them() -> None:
    """Defect (session 33): README's `RuntimeOptions(fp32_master=False)` had no import path; `agent.RuntimeOptions`
    raised AttributeError."""
    import agent
    from agent.runtime import RuntimeOptions

    assert agent.RuntimeOptions is RuntimeOptions and "RuntimeOptions" in dir(agent)


def test_a_batch_of_more_rows_but_no_more_tokens_and_no_longer_sequence_is_within_the_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect (session 33): the guard compared rows and sequence alone, while a job of several ranks plans for the
    rank batch with the most tokens, then the longest sequence: ranks whose first batches were 4 x 32 and 2 x 64
    planned for 2 x 64, and rank 0's own 4 x 32 was "larger than planned" (refused on a GPU), though its
    activations (tokens, and tokens x sequence for attention scores) are within the plan's."""
    import logging

    from agent.batch_guard import BatchShapeError, BatchShapeGuard, within_plan
    from agent.runtime.process_group import batch_order

    assert max([(4, 32), (2, 64)], key=batch_order) == (2, 64)
    assert within_plan((4, 32), (2, 64)) and within_plan((2, 64), (2, 64)) and within_plan((1, 16), (2, 64))
    assert not within_plan((2, 65), (2, 64)) and not within_plan((3, 64), (2, 64))
    assert not within_plan((2, 64), (8, 32))  # fewer tokens, but a longer sequence: attention grows with it
    guard = BatchShapeGuard(nn.Linear(2, 2), (2, 64), torch.device("cuda", 0))
    caplog.set_level(logging.WARNING, logger="agent")
    guard._check(nn.Linear(2, 2), (), {"input_ids": torch.zeros(4, 32, dtype=torch.long)})
    assert not caplog.records
    with pytest.raises(BatchShapeError):
        guard._check(nn.Linear(2, 2), (), {"input_ids": torch.zeros(4, 64, dtype=torch.long)})
