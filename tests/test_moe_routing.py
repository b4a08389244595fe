"""MoE routing and dispatch options: group-limited routing, expert bias, token dropping, the flex dispatcher.

Validation mirrors TransformerConfig.__post_init__ / the token dispatchers of Megatron-Core 0.19.2 (one line per
refusal, with a hint that validates); the planner charges the flex dispatcher's network traffic per remote node
(``remote_nodes_per_token``) instead of per routed expert, and padded token dropping by its capacity factor.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from launcher.config import compose_job
from launcher.core import derive
from launcher.plan.timing import remote_nodes_per_token, step_time
from launcher.validate import errors, validate

MOE_CPU = ["recipe=smoke", "data=mock", "model.num_experts=4", "parallel.tensor=1"]


def _errors(*overrides):
    return errors(validate(compose_job([*MOE_CPU, *overrides])))


@pytest.mark.parametrize("overrides,field", [
    (["model.moe_router_num_groups=2"], "model.moe_router_num_groups"),
    (["model.moe_router_group_topk=1"], "model.moe_router_group_topk"),
    (["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"], "model.moe_router_num_groups"),
    (["model.moe_router_num_groups=2", "model.moe_router_group_topk=3"], "model.moe_router_group_topk"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=1"], "model.moe_router_group_topk"),  # 1 x 1 < top-2
    (["model.moe_router_enable_expert_bias=true"], "model.moe_router_enable_expert_bias"),  # softmax scores
    (["model.moe_pad_expert_input_to_capacity=true"], "model.moe_pad_expert_input_to_capacity"),
    (["model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor"),
    (["model.moe_expert_capacity_factor=1.0", "model.moe_router_load_balancing_type=sinkhorn",
      "model.moe_aux_loss_coeff=0.0"], "model.moe_expert_capacity_factor"),
    (["model.moe_token_dispatcher_type=flex"], "model.moe_token_dispatcher_type"),  # CPU: no DeepEP/HybridEP
])
def test_invalid_routing_is_refused_with_one_line_and_a_hint_that_validates(overrides, field):
    errs = _errors(*overrides)
    assert errs and errs[0].field == field, [str(e) for e in errs]
    fixed = [*overrides, *errs[0].hint.split(" or ")[0].split()]
    again = [e for e in _errors(*fixed) if e.field == field]
    assert not again, f"hint {errs[0].hint!r} does not fix {field}: {[str(e) for e in again]}"


def test_valid_routing_options_pass_on_cpu():
    assert not _errors("model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
                       "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
                       "model.moe_router_topk_scaling_factor=2.5", "model.moe_expert_capacity_factor=1.25",
                       "model.moe_pad_expert_input_to_capacity=true")


def test_flex_dispatcher_rules_on_gpu():
    gpu = ["recipe=qwen3_30b_a3b", "model.moe_token_dispatcher_type=flex"]
    assert not errors(validate(compose_job(gpu)))
    one = errors(validate(compose_job([*gpu, "parallel.expert=1", "parallel.tensor=1"])))
    assert any(e.field == "model.moe_token_dispatcher_type" and "tensor x parallel.expert" in e.rule for e in one)
    pad = errors(validate(compose_job([*gpu, "model.moe_expert_capacity_factor=1.0",
                                      "model.moe_pad_expert_input_to_capacity=true"])))
    assert [e.field for e in pad] == ["model.moe_pad_expert_input_to_capacity"]
    assert not errors(validate(compose_job([*gpu, "model.moe_expert_capacity_factor=1.0",
                                           "model.moe_pad_expert_input_to_capacity=true",
                                           "model.moe_flex_dispatcher_backend=hybridep"])))


def test_remote_nodes_per_token():
    m = compose_job(["recipe=llama3_70b", "model=deepseek_v3"]).model
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (8, 4)
    assert remote_nodes_per_token(m, 1) == 0.0
    assert remote_nodes_per_token(m, 8) == pytest.approx(4 * 7 / 8)  # node-limited: 4 of 8 groups (= nodes)
    free = dataclasses.replace(m, moe_router_num_groups=None, moe_router_group_topk=None)
    miss = math.comb(256 - 32, 8) / math.comb(256, 8)  # no group limit: a node is missed by all 8 experts
    assert remote_nodes_per_token(free, 8) == pytest.approx(7 * (1 - miss))
    assert remote_nodes_per_token(free, 2) < remote_nodes_per_token(free, 4) < remote_nodes_per_token(free, 8) < 7
    few = dataclasses.replace(m, num_experts=16, moe_router_topk=8, moe_router_num_groups=None)
    assert remote_nodes_per_token(few, 16) == pytest.approx(15 * 8 / 16)  # one expert per node: k of N nodes


def _ep_comm(*overrides) -> float:
    job = compose_job(["recipe=deepseek_v3", *overrides])
    return step_time(job, derive(job)).breakdown_s["ep_comm"]


def test_flex_dispatch_sends_less_over_the_network_than_alltoall():
    base = ["parallel.moe_a2a_overlap=false"]
    a2a, flex = _ep_comm(*base, "model.moe_token_dispatcher_type=alltoall"), _ep_comm(
        *base, "model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=hybridep")
    assert 0 < flex < 0.75 * a2a, (flex, a2a)


def test_padded_token_dropping_costs_its_capacity_factor():
    job = compose_job(["recipe=qwen3_30b_a3b"])
    dropless = step_time(job, derive(job)).breakdown_s
    padded = compose_job(["recipe=qwen3_30b_a3b", "model.moe_expert_capacity_factor=1.5",
                          "model.moe_pad_expert_input_to_capacity=true"])
    pad = step_time(padded, derive(padded)).breakdown_s
    assert pad["gemm"] > dropless["gemm"] and pad["ep_comm"] >= dropless["ep_comm"]
    unpadded = compose_job(["recipe=qwen3_30b_a3b", "model.moe_expert_capacity_factor=1.5"])
    assert step_time(unpadded, derive(unpadded)).breakdown_s["gemm"] == pytest.approx(dropless["gemm"])
