"""ZB-H1 + FP8 + linear biases is refused: Transformer Engine's delayed-wgrad ``backward_dw`` sets a bias
gradient from the GEMM's bgrad, which is None under FP8 (the bias gradient is computed in B instead), and a
stage that runs a second B before the first W then finds no bias grad to keep (launcher/validate/schedule.py
zb_h1_rules cites the TE lines)."""
from __future__ import annotations

import pytest

ZB = ["recipe=llama3_8b", "cluster=h100", "nodes=2", "parallel.pipeline=2", "parallel.overlap_grad_reduce=false",
      "parallel.overlap_param_gather=false", "schedule.kind=zb_h1", "action=validate"]


@pytest.mark.parametrize("bias", ["model.add_bias_linear", "model.add_qkv_bias"])
def test_fp8_with_biases_is_refused_with_one_line(cli, bias):
    code, _, err = cli(*ZB, f"{bias}=true")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {bias}=True: zb_h1") and "backward_dw" in lines[0], lines[0]
    assert "transformer_engine/pytorch/module/base.py" in lines[0]
    assert f"try {bias}=false or precision.fp8=null precision.fp8_param=false" in lines[0], lines[0]


@pytest.mark.parametrize("fix", [["model.add_bias_linear=false"], ["precision.fp8=null", "precision.fp8_param=false"],
                                 ["schedule.kind=1f1b"]])
def test_each_stated_alternative_validates(cli, fix):
    code, out, err = cli(*ZB, "model.add_bias_linear=true", *fix)
    assert code == 0, err
