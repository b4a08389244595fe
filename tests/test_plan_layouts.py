"""Pipeline splits as NVIDIA states them: embedding/loss counted as layers, or an explicit per-chunk layout.

The derived layout (``launcher.core.derive``) must place exactly the decoder layers Megatron-Core builds
(``get_num_layers_to_build`` / ``PipelineParallelLayerLayout``), validation must refuse what Megatron-Core
refuses, and a real CPU run with an uneven split must train exactly like one process.
"""
from __future__ import annotations

import pytest

from _rank_harness import TINY, layout, train
from launcher.config import compose_job
from launcher.core import derive
from launcher.core.layout import parse_pipeline_layout
from launcher.validate import validate

L405 = ["recipe=llama405b", "parallel.first_stage_layers=null", "parallel.last_stage_layers=null"]
DSV3 = ["recipe=llama3_70b", "model=deepseek_v3", "nodes=128", "parallel.tensor=2", "parallel.pipeline=8",
        "parallel.virtual_pipeline=4", "parallel.context=1", "parallel.expert=64", "parallel.sequence_parallel=true",
        "parallel.tp_comm_overlap=false", "schedule.kind=interleaved", "train.global_batch_size=512"]
ACCOUNT = ["parallel.account_for_embedding_in_pipeline_split=true", "parallel.account_for_loss_in_pipeline_split=true"]


def _errors(job) -> list[str]:
    return [p.line() for p in validate(job) if p.severity == "error"]


def test_layout_string_grammar_matches_megatron():
    assert parse_pipeline_layout("Et|(tt|)*2,mL") == ["Et", "tt", "tt", "mL"]
    assert parse_pipeline_layout("Et*3|t*2L") == ["Ettt", "ttL"]
    with pytest.raises(ValueError, match="unknown layer letter"):
        parse_pipeline_layout("Ex|L")


def test_405b_counts_embedding_and_loss_as_layers():
    job = compose_job(L405 + ACCOUNT + ["parallel.virtual_pipeline=8", "schedule.kind=interleaved"])
    lay = derive(job)
    assert not _errors(job)
    assert lay.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15) and lay.vpp == 8
    assert [len(c) for c in lay.chunk_layers[0]] == [1] + [2] * 7  # chunk 0 shares its slot with the embedding
    assert [len(c) for c in lay.chunk_layers[-1]] == [2] * 7 + [1]  # the last chunk with the loss
    flat = sorted(i for stage in lay.chunk_layers for chunk in stage for i in chunk)
    assert flat == list(range(126))
    # Megatron's order: virtual stage k*PP + r; stage 1's first chunk follows stage 0's first chunk
    assert lay.chunk_layers[1][0] == (1, 2)


def test_deepseek_explicit_layout():
    job = compose_job(DSV3 + ["parallel.pipeline_model_parallel_layout='Et|(tt|)*30mL'"])
    lay = derive(job)
    assert not _errors(job)
    assert lay.stage_layers == (7, 8, 8, 8, 8, 8, 8, 6) and lay.vpp == 4
    assert lay.chunk_layers[0][0] == (0,) and lay.chunk_layers[-1][-1] == ()


@pytest.mark.parametrize("extra,field", [
    (ACCOUNT + ["parallel.first_stage_layers=15"], "parallel.account_for_embedding_in_pipeline_split"),
    (["parallel.account_for_embedding_in_pipeline_split=true"], "parallel.account_for_embedding_in_pipeline_split"),
    (["parallel.pipeline_model_parallel_layout='Et|(tt|)*30tL'"], "parallel.pipeline_model_parallel_layout"),
    (["parallel.pipeline_model_parallel_layout='Et|(tt|)*29mL'"], "parallel.pipeline_model_parallel_layout"),
    (["parallel.pipeline_model_parallel_layout='tE|(tt|)*30mL'"], "parallel.pipeline_model_parallel_layout"),
    (["parallel.pipeline_model_parallel_layout='Et|(tt|)*30mL'", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline"),
    (["parallel.pipeline_model_parallel_layout='Et|(tt|)*30mL'"] + ACCOUNT,
     "parallel.pipeline_model_parallel_layout"),
])
def test_invalid_splits_are_refused_naming_the_field(extra, field):
    base = L405 if extra[0].startswith("parallel.account") else DSV3
    if base is L405 and "first_stage_layers" in " ".join(extra):
        base = ["recipe=llama405b"]
    errors = _errors(compose_job(base + extra))
    assert any(e.startswith(f"error: {field}=") for e in errors), errors


def test_existing_recipes_keep_their_split():
    lay = derive(compose_job(["recipe=llama405b"]))
    assert lay.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    lay = derive(compose_job(["recipe=llama3_70b"]))
    assert sum(lay.stage_layers) == 80 and len(set(lay.stage_layers)) == 1


# --------------------------------------------------------------------- real CPU training, uneven splits
STEPS = 5
BASE = TINY + ["model.num_layers=5", f"train.train_steps={STEPS}"]


def _same_losses(ref, other, name):
    r, o = ref.losses(), other.losses()
    assert sorted(o) == list(range(1, STEPS + 1)), name
    for step in r:
        assert o[step] == pytest.approx(r[step], rel=1e-6), f"{name} step {step}: {o} vs {r}"
    assert r[STEPS] < r[1] - 0.05


def test_uneven_splits_train_like_one_process(tmp_path):
    ref = train(tmp_path, "pp1", 1, BASE + layout())
    # 5 layers + the embedding counted as one = 6 = 2 stages x 3: stage 0 builds 2 decoder layers, stage 1 3
    emb = train(tmp_path, "pp2_emb", 2, BASE + layout(pp=2) + ["parallel.account_for_embedding_in_pipeline_split=true"])
    _same_losses(ref, emb, "pp2 account_for_embedding")
    # explicit layout, PP2 x VPP2, chunks of 1, 2, 1, 1 decoder layers (stage 0: [0] [3]; stage 1: [1 2] [4])
    lay = train(tmp_path, "pp2vpp2_layout", 2, BASE + layout(pp=2, vpp=2)
                + ["parallel.pipeline_model_parallel_layout='Et|tt|t|tL'", "schedule.batch_p2p_comm=false"])
    _same_losses(ref, lay, "pp2 x vpp2 explicit layout")
