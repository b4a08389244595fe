"""``launcher.core.run_identity``'s tables are total: every flattened schema field is classified as the run's
identity (``IDENTITY``) or not (``NOT_IDENTITY``), each with why, and ``run_identity`` records exactly the
``IDENTITY`` ones."""
from __future__ import annotations

import dataclasses

from launcher import schema
from launcher.config import compose_job
from launcher.core.run_identity import IDENTITY, NOT_IDENTITY, run_identity


def flattened_fields(job_cls=schema.JobConfig, sections=schema.SECTIONS) -> list[str]:
    """Every schema field as 'section.field' (top-level ones bare), walking the dataclasses."""
    names = []
    for f in dataclasses.fields(job_cls):
        cls = sections.get(f.name)
        names += [f"{f.name}.{g.name}" for g in dataclasses.fields(cls)] if cls else [f.name]
    return names


def unclassified(names) -> list[str]:
    return [n for n in names if n not in IDENTITY and n not in NOT_IDENTITY]


def test_every_schema_field_is_identity_or_not_with_a_reason():
    names = flattened_fields()
    assert not unclassified(names)
    both = set(IDENTITY) & set(NOT_IDENTITY)
    gone = (set(IDENTITY) | set(NOT_IDENTITY)) - set(names)
    assert not both and not gone, (both, gone)
    assert all(why.strip() for why in {**IDENTITY, **NOT_IDENTITY}.values())


def test_a_new_unclassified_field_is_found():
    @dataclasses.dataclass
    class GrownTrain(schema.TrainConfig):
        ema_decay: float = 0.0

    @dataclasses.dataclass
    class GrownJob(schema.JobConfig):
        train: GrownTrain = dataclasses.field(default_factory=GrownTrain)

    assert unclassified(flattened_fields(GrownJob, {**schema.SECTIONS, "train": GrownTrain})) == ["train.ema_decay"]


def test_run_identity_records_exactly_the_identity_fields():
    for overrides in (["recipe=smoke", "+cluster.env.NCCL_DEBUG=INFO"], ["recipe=qwen3_30b_a3b"]):
        assert set(run_identity(compose_job(overrides))) == set(IDENTITY), overrides


def test_a_not_identity_change_keeps_the_identity_and_an_identity_change_does_not():
    base = run_identity(compose_job(["recipe=smoke"]))
    assert run_identity(compose_job(["recipe=smoke", "train.train_steps=40", "logging.log_interval=5",
                                     "cluster.gemm_efficiency=0.5"])) == base
    assert run_identity(compose_job(["recipe=smoke", "train.lr=1e-4"])) != base
