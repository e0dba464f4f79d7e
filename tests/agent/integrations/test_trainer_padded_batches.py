"""`wrap_trainer` on a Trainer whose collator pads each batch to its longest example (Hugging Face's
`DataCollatorForLanguageModeling`, `DataCollatorWithPadding`: the usual setup for tokenised text).

Defect (session 9 QA): `wrap_trainer` profiled the first `per_device_train_batch_size` examples, so the plan
was made for their padded length, and every later batch with a longer example was larger than planned: a
warning on CPU, `BatchShapeError` before the forward on a GPU (training stopped at the first long batch). Now
it profiles the longest examples of the training set (their collated batch is the largest a padding collator
makes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from agent.integrations.hf import sample_batch

VOCAB = 64


class PadToLongest:
    """Pads `input_ids` to the batch's longest example; labels -100 and attention mask 0 on the padding."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), longest), 1)
        mask = torch.zeros((len(features), longest), dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer(tmp_path: Path, lengths: list[int]) -> transformers.Trainer:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    data = [{"input_ids": list(range(2, 2 + n))} for n in lengths]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        remove_unused_columns=False,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=PadToLongest())


def test_the_profiled_batch_is_the_largest_a_padding_collator_makes(tmp_path: Path) -> None:
    t = trainer(tmp_path, [5, 7, 30, 4, 22, 9])
    batch = sample_batch(t)
    assert tuple(batch["input_ids"].shape) == (2, 30)  # the two longest examples: 30 and 22, padded to 30
    assert int(batch["attention_mask"].sum()) == 52 and int((batch["labels"] == -100).sum()) == 8


@pytest.mark.parametrize("lengths", [[6, 6, 6], [3]], ids=["equal_lengths", "fewer_than_a_batch"])
def test_equal_lengths_and_a_small_set_keep_the_first_examples(tmp_path: Path, lengths: list[int]) -> None:
    batch = sample_batch(trainer(tmp_path, lengths))
    assert tuple(batch["input_ids"].shape) == (min(2, len(lengths)), lengths[0])
