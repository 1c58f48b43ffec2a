"""Two spellings of one run resolve to the same thing, so the parity matrix needs no row for each.

* ``model.norm_type = "fused_rmsnorm"`` (torchtitan's name for the fused kernel) builds the same
  ``nn.RMSNorm`` modules as ``rmsnorm``: torch 2.13's RMSNorm already runs ``aten::_fused_rms_norm``;
  the same seed gives the same weights and the same logits, bit for bit.
* A CSV schedule named by torchtitan's schedule class (``PipelineScheduleMulti``) is the placement
  ``loop``: the same canonical schedule and the same stages.

(Before: the matrix rows fsdp2_fused_rmsnorm, fsdp2_tp2_fused_rmsnorm and pp2_csv_schedule_multi, each
trained and compared bit-exactly with its twin. tests/runs/training/test_parity_matrix.py keeps the one-process
fused_rmsnorm run, which also checks the log line naming the kernel.)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchtitan.distributed.pipeline.layout import canonical_schedule, resolve_stage_layout
from torchtitan.models.llama import Transformer, llama3_configs

CSV = "./tests/assets/pp2_breadth_first_4stages_4mb.csv"


def _model(norm_type: str) -> Transformer:
    args = dataclasses.replace(llama3_configs["debugmodel_tiny"], vocab_size=256, max_seq_len=32, norm_type=norm_type)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def test_fused_rmsnorm_builds_the_same_modules_and_logits():
    fused, plain = _model("fused_rmsnorm"), _model("rmsnorm")
    kinds = {name: type(m) for name, m in fused.named_modules()}
    assert kinds == {name: type(m) for name, m in plain.named_modules()}
    assert sum(isinstance(m, nn.RMSNorm) for m in fused.modules()) == 2 * len(fused.layers) + 1
    for (name, a), b in zip(fused.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused(tokens), plain(tokens))


def test_a_layernorm_is_not_the_same_spelling():
    """The check above can fail: another norm type builds other modules."""
    assert not any(isinstance(m, nn.RMSNorm) for m in _model("layernorm").modules())


def test_csv_schedule_class_name_is_the_loop_placement():
    assert canonical_schedule("PipelineScheduleMulti", CSV) == canonical_schedule("loop", CSV) == "loop"
    assert canonical_schedule("PipelineScheduleSingle", CSV) == "single"
    multi = resolve_stage_layout(4, 2, "PipelineScheduleMulti", [], CSV)
    assert multi == resolve_stage_layout(4, 2, "loop", [], CSV) == [(0, 1), (1, 2), (2, 3), (3, 4)]
