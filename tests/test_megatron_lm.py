"""Megatron-LM users at home: their names as hints, their launch scripts imported, our jobs exported.

The Megatron-LM side is checked against Megatron-LM itself where it is installed (the venv's megatron-core
0.19.2 wheel ships ``megatron.training``): every argument name in our table is an option of its parser, every
exported job parses there, and the FLOPs/token of every imported test script is its
``num_floating_point_operations`` (with the unpadded vocabulary, as ``launcher/core/flops.py`` counts).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

from conftest import RECIPES, ROOT
from launcher.config import compose_job
from launcher.megatron_lm.importer import import_job, load_command
from launcher.megatron_lm.table import COMBINED, FLAGS, IGNORED, LAUNCHER_ONLY, UNSUPPORTED
from launcher.megatron_lm.export import to_args
from launcher.megatron_lm.translate import Args, flatten, freq_and_dense, layer_pattern_text, parse_layer_pattern
from launcher.schema import JobConfig

FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"


@lru_cache(maxsize=None)
def _megatron():
    """(Megatron-LM's argument parser, its num_floating_point_operations), or None where not installed."""
    import typing
    if not hasattr(typing, "override"):  # megatron.training 0.19.2 imports typing.override (Python 3.12)
        typing.override = lambda f: f
    try:
        from megatron.training.arguments import add_megatron_arguments
        from megatron.training.training import num_floating_point_operations
    except ImportError:
        return None
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser, num_floating_point_operations


def megatron_or_skip():
    found = _megatron()
    if found is None:
        pytest.skip("megatron.training is not installed")
    return found


# ---------------------------------------------------------------------------------------------- hints

HINTS = [
    (["recipe=llama405b", "tensor_model_parallel_size=4"],
     "tensor_model_parallel_size is Megatron's name for parallel.tensor; try parallel.tensor=4"),
    (["recipe=llama405b", "--tensor-model-parallel-size", "4"],
     "--tensor-model-parallel-size is Megatron's name for parallel.tensor; try parallel.tensor=4"),
    (["recipe=llama405b", "--tensor-model-parallel-size=4"], "try parallel.tensor=4"),
    (["recipe=llama405b", "micro_batch_size=2"], "try train.micro_batch_size=2"),
    (["recipe=llama405b", "seq_length=4096"], "try model.seq_length=4096"),
    (["recipe=llama405b", "num_query_groups=16"], "try model.num_query_groups=16"),
    (["recipe=llama405b", "recompute_granularity=full"],
     "recompute_granularity is Megatron's name for train.recompute; try train.recompute=full"),
    (["recipe=llama405b", "parallel.tensor_model_parallel_size=4"], "try parallel.tensor=4"),
    (["recipe=llama405b", "train.seq_length=4096"], "try model.seq_length=4096"),
    (["recipe=llama405b", "num_moe_experts=8"], "num_moe_experts is Megatron's name for model.num_experts"),
    (["recipe=llama405b", "layernorm_epsilon=1e-6"], "try model.norm_epsilon=1e-6"),
    (["recipe=llama405b", "--bf16"], "try precision.dtype=bf16"),
    (["recipe=llama405b", "untie_embeddings_and_output_weights=true"], "try model.tie_embeddings=false"),
    (["recipe=llama405b", "train_iters=100"], "try train.train_steps=100"),
    (["recipe=llama405b", "--lr-decay-style", "WSD"], "try train.lr_schedule=wsd"),
    (["recipe=llama405b", "attention_backend=flash"], "no effect here"),
    (["recipe=llama405b", "--apply-layernorm-1p"], "no equivalent here"),
    (["recipe=llama405b", "add_bias_linear=true"], "try model.add_bias_linear=true"),  # Core's polarity
    (["recipe=llama405b", "--disable-bias-linear"], "try model.add_bias_linear=false"),  # the flag's
    (["recipe=llama405b", "--dry-run"], "--dry-run is not a flag here; try action=render"),
    (["recipe=llama405b", "action=import"], "try python -m launcher import"),
    (["recipe=llama405b", "parallel.tensorr=2"], "parallel.tensorr='2': no such field"),
    (["recipe=llama405b", "parallel.tensorr=2"], "try parallel.tensor=2"),
    (["recipe=llama405b", "paralel.tensor=2"], "try parallel.tensor=2"),
    # activation offloading (issue 41): Megatron's switch and its module list are one list field here
    (["recipe=qwen3_30b_a3b", "--offload-modules", "core_attn", "expert_fc1"],
     "try train.activation_offload_modules=[core_attn,expert_fc1]"),
    (["recipe=qwen3_30b_a3b", "--fine-grained-activation-offloading"], "try train.activation_offload_modules=[qkv_linear]"),
    (["recipe=qwen3_30b_a3b", "--activation-offload-fraction", "0.5"], "try train.activation_offload_fraction=0.5"),
]


@pytest.mark.parametrize("argv,expected", HINTS, ids=[" ".join(a[1:]) for a, _ in HINTS])
def test_megatron_names_and_neighbours_flags_get_our_field(argv, expected, cli):
    code, out, err = cli(*argv)
    assert code == 2
    assert "Traceback" not in err
    assert expected in err, err
    assert "''" not in err  # the value typed is shown, never an empty string


@pytest.mark.parametrize("argv,expected", [h for h in HINTS if "; try " in h[1] and "=" in h[1].rsplit("try ", 1)[1]
                                           and "import" not in h[1]][:12])
def test_a_hinted_override_composes(argv, expected, cli):
    suggestion = expected.rsplit("try ", 1)[1].split()
    job = compose_job(["recipe=llama405b", *suggestion])
    key, value = suggestion[0].split("=", 1)
    got = job
    for part in key.split("."):
        got = getattr(got, part)
    assert str(got).lower() == value.lower() or float(got) == float(value)


# ---------------------------------------------------------------------------------------------- table


def test_every_schema_field_is_mapped_or_said_to_be_launcher_only():
    covered = {f.field for f in FLAGS} | {x.strip() for v in COMBINED.values() for x in v.split(",")}
    covered |= {"nodes", "cluster.gpus_per_node", "cluster.backend"} | set(LAUNCHER_ONLY)
    missing = [k for k in flatten(JobConfig()) if k not in covered and not k.startswith(("cluster.", "slurm."))]
    assert not missing, f"say in launcher/megatron_lm/table.py which Megatron-LM argument sets {missing}"


def test_every_argument_name_is_megatron_lms():
    parser, _ = megatron_or_skip()
    options = {o for a in parser._actions for o in a.option_strings}
    names = [f.flag for f in FLAGS] + list(COMBINED) + list(IGNORED) + list(UNSUPPORTED)
    assert [n for n in names if n not in options] == []
    assert not set(IGNORED) & set(UNSUPPORTED) and not {f.flag for f in FLAGS} & (set(IGNORED) | set(UNSUPPORTED))


@pytest.mark.parametrize("text,freq,first_k", [("([0]*3+[1]*58)", 1, 3), ("[1,0,1,0]", 2, 0), ("[0,1,1,1]", 1, 1)])
def test_moe_layer_patterns_both_ways(text, freq, first_k):
    pattern = parse_layer_pattern(text)
    assert freq_and_dense(pattern) == (freq, first_k)
    text_back = layer_pattern_text(len(pattern), freq, first_k)
    if first_k == 0:
        assert text_back == str(freq)  # Megatron-LM's integer form: layer i is MoE iff i % freq == 0
    else:
        assert parse_layer_pattern(text_back) == pattern


# ---------------------------------------------------------------------------------------------- export / round trip

OFFLOAD_JOB = ["recipe=qwen3_30b_a3b", "train.activation_offload_modules=[qkv_linear,core_attn,attn_proj,expert_fc1]",
               "train.activation_offload_fraction=0.5", "train.min_offloaded_tensor_size=65536"]
"""Fine-grained activation offloading (issue 41) with its fraction and size threshold."""
VARIANTS = [[f"recipe={r}"] for r in RECIPES] + [
    ["recipe=llama3_8b", "model=deepseek_v3", "parallel.expert=8", "parallel.context=1"],  # MoE + MLA + MTP
    ["recipe=llama3_8b", "model=qwen3_30b_a3b", "parallel.expert=8", "train.recompute=full",
     "train.recompute_num_layers=2", "train.lr_schedule=wsd", "train.wsd_decay_steps=500"],
    ["recipe=llama3_8b", "precision.fp8=tensorwise", "precision.transformer_engine=true",
     "checkpoint.dir=/lustre/ck", "checkpoint.load=/lustre/other", "logging.wandb_project=p"],
    # CUDA graphs (issue 41): TE's per-layer graphs over attention and the MoE router, 2 warm-up steps
    ["recipe=qwen3_30b_a3b", "train.cuda_graph_impl=transformer_engine",
     "train.cuda_graph_modules=[attn,moe_router,moe_preprocess]", "train.cuda_graph_warmup_steps=2"],
    OFFLOAD_JOB,
]


def _export_import(job, tmp_path: Path):
    exported = to_args(job)
    script = tmp_path / "exported.sh"
    script.write_text(exported.script("round trip"))
    done = import_job(script, output=tmp_path / "recipe" / "roundtrip.yaml", cluster=job.cluster.name,
                      name=job.name)
    return exported, done


@pytest.mark.parametrize("overrides", VARIANTS, ids=[" ".join(v) for v in VARIANTS])
def test_import_of_export_gives_back_the_job(overrides, tmp_path):
    job = compose_job(overrides)
    exported, done = _export_import(job, tmp_path)
    before, after = flatten(job), flatten(done.job)
    # slurm.* is the site's submission profile: no Megatron-LM argument carries it
    diff = {k: (before[k], after[k]) for k in before if before[k] != after[k] and not k.startswith("slurm.")}
    assert diff == {}
    assert exported.not_expressible == []
    assert all(e.status == "mapped" for e in done.report
               if e.flag not in ("--tokenizer-type", "--attention-softmax-in-fp32")), \
        [e.line() for e in done.report if e.status != "mapped"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_exported_arguments_parse_in_megatron_lm(recipe):
    parser, _ = megatron_or_skip()
    job = compose_job([f"recipe={recipe}"])
    ns = parser.parse_args(to_args(job).args)
    assert ns.tensor_model_parallel_size == job.parallel.tensor
    assert ns.pipeline_model_parallel_size == job.parallel.pipeline
    assert ns.num_layers == job.model.num_layers and ns.global_batch_size == job.train.global_batch_size


IMPLEMENTATION = {
    # TransformerConfig attributes that choose kernels or bookkeeping, not what is computed
    "persist_layer_norm", "gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion",
    "apply_rope_fusion", "use_cpu_initialization",
    "tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards",  # derived from TP / ETP
    "inference_sampling_seed",  # inference only
    "cp_comm_type",  # None here; Megatron-Core's TE attention reads None as Megatron-LM's default 'p2p'
    "attention_backend",  # which fused attention kernel TE uses (--attention-backend is reported as ignored)
}


NOT_READ = {
    # DDP / optimizer config attributes that differ in value but are not read for these jobs, with why
    "check_for_nan_in_grad": "our training loop checks the loss and gradient norm itself (train.nonfinite)",
    "data_parallel_sharding_strategy": "read by Megatron FSDP only (parallel.megatron_fsdp=false here)",
    "fp8_recipe": "read only with FP8 on",
    "muon_momentum": "Muon optimizer only", "optimizer_offload_fraction": "read only with optimizer CPU offload",
    "barrier_with_L1_time": "timers only",
    "use_custom_fsdp": "the deprecated alias Megatron-LM sets beside use_megatron_fsdp; no Megatron-Core 0.19.2 code "
                       "reads it",
}


def _config_differences(argv, env, nodes, gpus, job, monkeypatch, skip=()):
    """Megatron-LM's own validate_args and core_transformer_config_from_args on ``argv`` give the
    TransformerConfig our rank wing builds for ``job``, attribute by attribute (on a pretend Hopper), and its
    training.py the same DistributedDataParallelConfig, OptimizerConfig and learning-rate schedule: the
    differences, if any."""
    parser, _ = megatron_or_skip()
    import contextlib
    import inspect
    import io

    import torch
    import megatron.training.arguments as mlm_arguments
    from megatron.training.argument_utils import core_transformer_config_from_args
    from launcher.core import derive
    from models import builder

    monkeypatch.setattr(mlm_arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # our builder as on a GPU rank
    from megatron.core.transformer import transformer_config as tc_module
    monkeypatch.setattr(tc_module, "is_te_min_version", lambda *a, **k: True)  # MoE + FP8 asks for TE >= 1.7
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ns = parser.parse_args(argv)
    ns.rank, ns.world_size = 0, nodes * gpus
    with contextlib.redirect_stdout(io.StringIO()):
        mlm_arguments.validate_args(ns, {})
    lay = derive(job)
    assert (ns.data_parallel_size, ns.virtual_pipeline_model_parallel_size or 1) == (lay.dp, lay.vpp)
    ns.apply_rope_fusion = False  # needs Transformer Engine installed; a kernel choice (IMPLEMENTATION)
    theirs = core_transformer_config_from_args(ns)
    tr = job.train
    kwargs = dict(model=job.model, parallel=job.parallel, precision=job.precision, layout=lay, schedule=job.schedule,
                  recompute=tr.recompute, recompute_num_layers=tr.recompute_num_layers,
                  recompute_modules=getattr(tr, "recompute_modules", None), te=lay.transformer_engine,
                  activation_offload_modules=tr.activation_offload_modules,
                  activation_offload_fraction=tr.activation_offload_fraction,
                  min_offloaded_tensor_size=tr.min_offloaded_tensor_size)
    accepted = inspect.signature(builder.transformer_config).parameters
    ours = builder.transformer_config(**{k: v for k, v in kwargs.items() if k in accepted})
    assert type(ours) is type(theirs)

    def shown(name, x):
        if name == "moe_layer_freq" and isinstance(x, int):  # the integer form, spelled out per layer
            return [int(i % x == 0) for i in range(ours.num_layers)]
        if name == "add_qkv_bias":  # Megatron-LM sets it with add_bias_linear; the QKV bias is either's
            return bool(x or ours.add_bias_linear)
        return repr(x) if callable(x) or hasattr(x, "func") else x
    diff = {f.name: (shown(f.name, getattr(ours, f.name)), shown(f.name, getattr(theirs, f.name)))
            for f in dataclasses.fields(ours) if f.name not in IMPLEMENTATION and f.name not in skip
            and shown(f.name, getattr(ours, f.name)) != shown(f.name, getattr(theirs, f.name))}
    # ... and the DDP and optimizer configs Megatron-LM's training.py makes from the same arguments
    from launcher.rank import optim
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config
    pairs = [(optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=True),
              get_megatron_ddp_config(ns)),
             (optim.optimizer_config(train=tr, parallel=job.parallel, precision=job.precision, on_gpu=True),
              get_megatron_optimizer_config(ns)[0])]
    for mine, megatron in pairs:
        diff.update({f"{type(mine).__name__}.{f.name}": (getattr(mine, f.name), getattr(megatron, f.name))
                     for f in dataclasses.fields(mine) if f.name not in NOT_READ
                     and getattr(mine, f.name) != getattr(megatron, f.name)})
    # ... and the learning-rate schedule (Megatron-LM counts it in samples, we in steps)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", ns)

    def sgd():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    kwargs = optim.scheduler_kwargs(train=tr, steps=lay.steps)
    mine, megatron, gbs = OptimizerParamScheduler(sgd(), **kwargs), get_optimizer_param_scheduler(sgd()), \
        tr.global_batch_size
    for step in sorted({0, 1, tr.warmup_steps, tr.warmup_steps + 7, lay.steps // 2, lay.steps - 1, lay.steps}):
        mine.num_steps, megatron.num_steps = step, step * gbs
        a, b = mine.get_lr(mine.optimizer.param_groups[0]), megatron.get_lr(megatron.optimizer.param_groups[0])
        if a != pytest.approx(b, rel=1e-9, abs=1e-15):
            diff[f"lr at step {step}"] = (a, b)
    if (mine.start_wd, mine.end_wd) != (megatron.start_wd, megatron.end_wd):
        diff["weight decay"] = ((mine.start_wd, mine.end_wd), (megatron.start_wd, megatron.end_wd))
    return diff


@pytest.mark.parametrize("recipe", RECIPES)
def test_megatron_lm_builds_the_same_core_configs_from_the_export(recipe, monkeypatch):
    job = compose_job([f"recipe={recipe}"])
    exported = to_args(job)
    assert _config_differences(exported.args, exported.env, exported.nodes, exported.gpus_per_node, job,
                                    monkeypatch) == {}


def test_megatron_args_action_prints_a_launch(cli):
    code, out, err = cli("recipe=llama3_70b", "action=megatron-args")
    assert code == 0, err
    assert "torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py" in out
    for expected in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 4",
                     "--num-virtual-stages-per-pipeline-rank 5", "--context-parallel-size 2", "--fp8-format hybrid",
                     "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert expected in out
    code, out, _ = cli("recipe=llama3_70b", "action=megatron-args", "--json")
    assert code == 0 and '"not_expressible": []' in out


def test_what_megatron_lm_cannot_express_is_said():
    job = compose_job(["recipe=smoke", "schedule.kind=zb_h1", "checkpoint.keep_last=2"])
    missing = " ".join(to_args(job).not_expressible)
    assert "schedule.kind=zb_h1" in missing and "checkpoint.keep_last=2" in missing


# ---------------------------------------------------------------------------------------------- import of scripts

SCRIPTS = {
    # script: (import options, model entry, expected fields, {flag: status} spot checks)
    "llama3_8b_fp8_cp.sh": ({}, "llama3_8b", {
        "nodes": 1, "parallel.context": 2, "parallel.tensor": 1, "precision.fp8": "delayed",
        "precision.fp8_param": True, "precision.dtype": "bf16", "precision.grad_reduce_in_fp32": False,
        "train.global_batch_size": 128, "model.seq_length": 8192, "data.kind": "mock",
        "checkpoint.dir": "/lustre/ckpt/llama3_8b_fp8_cp", "checkpoint.resume": True,
        "name": "llama3_8b_fp8_cp", "train.exit_after_minutes": 230.0},
        {"--profile": "ignored", "--attention-backend": "ignored", "--fp8-format": "mapped",
         "--fp8-amax-history-len": "mapped"}),
    # the GPT-3 and Mixtral scripts are the architectures of recipes/model/{gpt3_175b,mixtral_8x7b}.yaml: matched
    "gpt3_175b.sh": ({"model_name": "gpt3_175b", "extra": {"data.tokenizer": "/lustre/data/gpt3/tokenizer.json"}},
                     "gpt3_175b", {
        "nodes": 16, "cluster.gpus_per_node": 8, "parallel.tensor": 8, "parallel.pipeline": 16,
        "model.num_layers": 96, "model.hidden_size": 12288, "model.ffn_hidden_size": 49152,
        "model.activation": "gelu", "model.normalization": "LayerNorm", "model.position_embedding": "learned_absolute",
        "model.tie_embeddings": True, "model.add_bias_linear": True, "model.vocab_size": 50257,
        "train.warmup_steps": 1, "train.recompute": "selective",
        "data.blend": [0.7, "/lustre/data/gpt3/pile_text_document", 0.3, "/lustre/data/gpt3/books_text_document"]},
        {"--vocab-file": "unsupported", "--merge-file": "unsupported", "--tokenizer-type": "unsupported",
         "--lr-warmup-fraction": "mapped"}),
    "mixtral_8x7b.sh": ({"model_name": "mixtral_8x7b"}, "mixtral_8x7b", {
        "nodes": 8, "cluster.gpus_per_node": 8, "parallel.pipeline": 4, "parallel.expert": 8,
        "model.num_experts": 8, "model.moe_router_topk": 2, "model.num_query_groups": 8,
        "model.moe_aux_loss_coeff": 0.01, "model.moe_token_dispatcher_type": "alltoall",
        "model.moe_grouped_gemm": True, "model.rotary_base": 1e6, "model.max_position_embeddings": 32768,
        "data.tokenizer": "/lustre/tokenizers/mixtral/tokenizer.json", "train.adam_beta2": 0.999},
        {"--no-load-optim": "unsupported", "--no-position-embedding": "ignored", "--moe-layer-freq": None}),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for script, (opts, _, _, _) in SCRIPTS.items():
        out[script] = import_job(FIXTURES / script, output=root / "recipe" / f"{Path(script).stem}.yaml", **opts)
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_with_every_argument_accounted_for(script, imported):
    done, (_, model, fields, spots) = imported[script], SCRIPTS[script]
    recorded = load_command(FIXTURES / script).args
    given = {f for f, _ in Args.parse(recorded).items}
    reported = [e for e in done.report if "absent" not in e.text and not e.text.startswith("export ")
                and e.flag != "(launcher)"]
    assert sorted(e.flag for e in reported) == sorted(given)  # one entry per argument: nothing dropped
    assert all(e.status in ("mapped", "ignored", "unsupported") and e.detail for e in done.report)
    status = {e.flag: e.status for e in reported}
    for flag, want in spots.items():
        assert status.get(flag) == want, (flag, status.get(flag))
    got = flatten(done.job)
    assert {k: got[k] for k in fields} == fields
    assert (done.new_model is None) == (model is not None)
    assert done.job.model.name == (model or Path(script).stem)


@pytest.mark.parametrize("script", SCRIPTS)
def test_imported_recipe_validates_and_plans_with_megatrons_flops(script, imported):
    from launcher.plan import plan_job
    from launcher.problems import errors
    from launcher.validate import validate
    done = imported[script]
    assert errors(validate(done.job)) == []
    plan = plan_job(done.job).to_dict()
    expected = {"llama3_8b_fp8_cp.sh": 51.470401536, "gpt3_175b.sh": 1061.877915648,
                "mixtral_8x7b.sh": 79.706456064}[script]  # Megatron-LM's num_floating_point_operations
    assert plan["gflops_per_token"] == pytest.approx(expected, rel=1e-9)
    found = _megatron()
    if found is not None:  # recompute the reference with Megatron-LM's own function
        parser, flops = found
        a = parser.parse_args(load_command(FIXTURES / script).args)
        h, n = a.hidden_size, a.num_attention_heads
        a.ffn_hidden_size = a.ffn_hidden_size or (int((4 * h * 2 / 3) / 64) * 64 if a.swiglu else 4 * h)
        a.kv_channels = a.kv_channels or h // n  # validate_args derives these two the same way
        a.padded_vocab_size = done.job.model.vocab_size  # unpadded, as our planner and NVIDIA's tables count
        per_token = flops(a, a.global_batch_size) / (a.global_batch_size * a.seq_length) / 1e9
        assert plan["gflops_per_token"] == pytest.approx(per_token, rel=1e-9)


def test_the_written_recipe_composes_by_name(imported):
    done = imported["gpt3_175b.sh"]
    root = done.recipe_path.parent.parent
    job = compose_job([f"hydra.searchpath=[file://{root}]", "recipe=gpt3_175b"])
    assert flatten(job) == flatten(done.job)
    assert job.model.name == "gpt3_175b" and not (root / "model" / "gpt3_175b.yaml").exists()  # the shipped entry


def test_an_arguments_file_imports_like_the_script(tmp_path, imported):
    args = load_command(FIXTURES / "llama3_8b_fp8_cp.sh").args
    lines = ["# the same job as an arguments file: comments, quotes, continuations"]
    lines += [f"{shlex.quote(a)} \\" for a in args] + ["  # end"]
    (tmp_path / "llama.args").write_text("\n".join(lines) + "\n")
    done = import_job(tmp_path / "llama.args", output=tmp_path / "recipe" / "llama_args.yaml")
    script_job = flatten(imported["llama3_8b_fp8_cp.sh"].job)
    assert {k: v for k, v in flatten(done.job).items() if k not in ("cluster.env",)} == \
           {k: v for k, v in script_job.items() if k not in ("cluster.env",)}


def test_import_command_end_to_end(cli, tmp_path):
    out_path = tmp_path / "recipe" / "mx.yaml"  # not a shipped recipe's name (recipes/recipe/mixtral.yaml)
    # a vocabulary of its own: no shipped model entry matches, so a new one is written
    code, out, err = cli("import", str(FIXTURES / "mixtral_8x7b.sh"), "--output", str(out_path), "--model", "mx",
                         "model.vocab_size=32768")
    assert code == 0, err
    assert "unsupported --no-load-optim" in out and "valid:" in out and "GFLOP/token" in out
    assert out_path.exists() and (tmp_path / "model" / "mx.yaml").exists()


def test_a_script_that_launches_nothing_is_refused(cli, tmp_path):
    script = tmp_path / "nothing.sh"
    script.write_text("#!/bin/bash\necho hello\n")
    code, _, err = cli("import", str(script), "--output", str(tmp_path / "recipe" / "x.yaml"))
    assert code == 2 and "without calling torchrun" in err


def test_exported_environment_tuning_is_kept_and_secrets_never_written(imported):
    done = imported["llama3_8b_fp8_cp.sh"]
    env = {e.flag: e for e in done.report if e.text.startswith("export ")}
    assert done.job.cluster.env["NCCL_P2P_NET_CHUNKSIZE"] == "2097152"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"].detail == "already in the cluster profile's env"
    assert env["HF_TOKEN"].status == "ignored" and env["SCRATCH_DIR"].status == "ignored"
    assert "hf_not_a_real_token" not in done.recipe_path.read_text()
    assert "hf_not_a_real_token" not in " ".join(e.line() for e in done.report)


def test_literal_dollar_braces_stay_literal(tmp_path):
    (tmp_path / "job.args").write_text(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--vocab-size 1024 --micro-batch-size 1 --train-iters 10 --lr 1e-3 --mock-data "
        "--save '/lustre/${oc.env:HOME}/ck' --load '/lustre/${oc.env:HOME}/ck'\n")
    done = import_job(tmp_path / "job.args", output=tmp_path / "recipe" / "lit.yaml", model_name="lit")
    assert done.job.checkpoint.dir == "/lustre/${oc.env:HOME}/ck"


def test_arguments_we_cannot_honour_are_reported_unsupported():
    from launcher.megatron_lm.translate import Launch, to_fields
    base = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--vocab-size", "1024", "--micro-batch-size", "1", "--lr", "1e-3",
            "--train-iters", "100", "--pipeline-model-parallel-size", "2"]
    extra = ["--lr-decay-iters", "80", "--recompute-granularity", "full", "--recompute-method", "block",
             "--num-layers-per-virtual-pipeline-stage", "2", "--apply-layernorm-1p", "--made-up-flag", "3"]
    values, report = to_fields(base + extra, Launch(nodes=1, gpus_per_node=8))
    status = {e.flag: e.status for e in report}
    assert status["--lr-decay-iters"] == status["--recompute-method"] == "unsupported"
    assert status["--apply-layernorm-1p"] == status["--made-up-flag"] == "unsupported"
    assert status["--num-layers-per-virtual-pipeline-stage"] == "mapped"
    assert values["parallel.virtual_pipeline"] == 2 and values["schedule.kind"] == "interleaved"
    assert values["schedule.overlap_p2p_comm"] is True  # Megatron-LM's default once interleaved
    # Megatron-LM's defaults, not ours, for what the arguments leave out
    assert (values["model.activation"], values["model.normalization"], values["model.tie_embeddings"],
            values["model.attention_dropout"], values["parallel.distributed_optimizer"]) == (
            "gelu", "LayerNorm", True, 0.1, False)


@pytest.mark.parametrize("script", SCRIPTS)
def test_megatron_lm_builds_the_imported_jobs_core_configs_from_the_script(script, imported, monkeypatch):
    command = load_command(FIXTURES / script)
    job = imported[script].job
    # The scripts do not pass --attention-softmax-in-fp32: Megatron-LM's unfused attention would take the softmax
    # in the model dtype, ours in fp32 (the import says so); Transformer Engine's fused attention, which both use
    # on GPUs, is not affected.
    diff = _config_differences(command.args, dict(command.launch.env), job.nodes, job.cluster.gpus_per_node,
                                    job, monkeypatch, skip=("attention_softmax_in_fp32",))
    assert diff == {}


def test_an_existing_recipe_is_not_overwritten(cli, tmp_path):
    code, _, err = cli("import", str(FIXTURES / "llama3_8b_fp8_cp.sh"), "--output",
                       str(ROOT / "recipes" / "recipe" / "llama3_8b.yaml"))
    assert code == 2 and "exists" in err and "--force" in err
    code, _, err = cli("import", str(FIXTURES / "llama3_8b_fp8_cp.sh"), "--output", str(tmp_path / "x.yaml"))
    assert code == 2 and "DIR/recipe/NAME.yaml" in err


def test_arguments_a_job_does_not_read_are_ignored_and_the_vocabulary_can_be_given(tmp_path):
    (tmp_path / "job.args").write_text(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --train-iters 10 --lr 1e-3 --mock-data --split 99,1,0 --moe-router-topk 4 "
        "--tokenizer-type Llama2Tokenizer --tokenizer-model /x/tokenizer.model\n")
    from launcher.megatron_lm.translate import ImportError_
    with pytest.raises(ImportError_, match="model.vocab_size=N"):
        import_job(tmp_path / "job.args", output=tmp_path / "recipe" / "a.yaml", model_name="a")
    done = import_job(tmp_path / "job.args", output=tmp_path / "recipe" / "a.yaml", model_name="a",
                      extra={"model.vocab_size": 32000})
    status = {e.flag: (e.status, e.detail) for e in done.report}
    assert status["--split"] == ("ignored", "not read with mock data")
    assert status["--moe-router-topk"] == ("ignored", "not read without --num-experts")
    assert done.job.model.vocab_size == 32000 and done.job.model.moe_router_topk == 2


def test_gpt2_vocab_and_merges_mean_the_gpt2_vocabulary():
    from launcher.megatron_lm.translate import Launch, to_fields
    values, _ = to_fields(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
                           "--train-iters", "10", "--lr", "1e-3", "--vocab-file", "v.json", "--merge-file", "m.txt",
                           "--data-path", "/d/x_text_document"], Launch(gpus_per_node=8))
    assert values["model.vocab_size"] == 50257


FSDP_JOB = ["recipe=llama3_8b", "cluster=h100", "parallel.context=1", "parallel.megatron_fsdp=true",
            "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8"]
"""NVIDIA's Llama3-8B layout on 8 H100s: Megatron-FSDP, no CP."""


def test_an_fsdp_export_passes_megatron_lms_validate_args_and_builds_the_same_core_configs(monkeypatch):
    """Megatron-LM refuses --use-megatron-fsdp unless --ckpt-format fsdp_dtensor: the export writes it, and
    Megatron-LM then builds the TransformerConfig, DDP and optimizer configs our ranks would."""
    job = compose_job(FSDP_JOB)
    exported = to_args(job)
    assert exported.args[exported.args.index("--ckpt-format") + 1] == "fsdp_dtensor"
    assert _config_differences(exported.args, exported.env, exported.nodes, exported.gpus_per_node, job,
                               monkeypatch) == {}


def test_an_activation_offload_export_passes_megatron_lms_validate_args_and_builds_the_same_core_configs(
        monkeypatch):
    """--fine-grained-activation-offloading --offload-modules ... and the environment's NVTE_CPU_OFFLOAD_V1=1, which
    Megatron-LM's validate_args asserts with TE >= 2.10 (this test's TE version check says yes): Megatron-LM then
    builds the TransformerConfig our ranks would, offload fields included."""
    job = compose_job(OFFLOAD_JOB)
    exported = to_args(job)
    assert exported.args[exported.args.index("--offload-modules") + 1:][:4] == ["qkv_linear", "core_attn",
                                                                               "attn_proj", "expert_fc1"]
    assert "--fine-grained-activation-offloading" in exported.args and exported.env["NVTE_CPU_OFFLOAD_V1"] == "1"
    assert _config_differences(exported.args, exported.env, exported.nodes, exported.gpus_per_node, job,
                               monkeypatch) == {}


def test_fsdp_plans_exports_validates_and_renders(cli, tmp_path):
    """Our ranks run Megatron-FSDP and write its fsdp_dtensor checkpoints (tests/test_fsdp.py), so every action
    takes the job: plan, megatron-args, validate and render (one bundle)."""
    for action in ("plan", "megatron-args", "validate", "render"):
        code, out, err = cli(*FSDP_JOB, f"output_dir={tmp_path}", f"action={action}")
        assert code == 0, err
    assert len(list(tmp_path.iterdir())) == 1  # the rendered bundle


def test_an_import_named_like_a_shipped_recipe_is_refused_with_a_free_name(cli, tmp_path):
    """Hydra searches the shipped recipes before the user's directory, so recipes/recipe/mixtral.yaml would shadow
    an imported DIR/recipe/mixtral.yaml: refused with one line naming a free name, which then imports."""
    out_path = tmp_path / "recipe" / "mixtral.yaml"
    args = (str(FIXTURES / "mixtral_8x7b.sh"), "--model", "mx", "model.vocab_size=32768")
    code, out, err = cli("import", args[0], "--output", str(out_path), *args[1:])
    assert code == 2 and "shipped recipe" in err and not out_path.exists(), err
    suggested = err.split("e.g. --output ")[1].split()[0]
    code, out, err = cli("import", args[0], "--output", suggested, *args[1:])
    assert code == 0 and Path(suggested).exists(), err


LIST_FLAGS_SCRIPT = """torchrun --nproc_per_node 8 pretrain_gpt.py \\
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \\
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \\
  --micro-batch-size 1 --global-batch-size 64 --lr 3e-4 --train-iters 100 --bf16 \\
  --recompute-granularity selective --recompute-modules core_attn mlp \\
  --cuda-graph-impl transformer_engine --cuda-graph-scope attn \\
  --data-path 0.5 /data/a_text_document 0.5 /data/b_text_document --vocab-size 32000
"""


def _shell_words(text: str) -> list:
    """The words a shell reads in a report's text (prose with a stray apostrophe reads as no override at all)."""
    try:
        return shlex.split(text)
    except ValueError:
        return []


@pytest.mark.parametrize("script", [*SCRIPTS, "list_flags.sh"])
def test_the_import_reports_each_mapping_as_an_override_that_composes(script, imported, tmp_path):
    """The report's mapped column is what the user would type: every key=value in it composes (a list is written
    [core_attn,mlp], not Python's ['core_attn', 'mlp']), and gives the value the recipe got."""
    import re

    from omegaconf import OmegaConf

    from launcher.config import compose_dict

    if script == "list_flags.sh":
        (tmp_path / script).write_text(LIST_FLAGS_SCRIPT)
        done = import_job(tmp_path / script, output=tmp_path / "recipe" / "list_flags.yaml", cluster="h100")
    else:
        done = imported[script]
    got = flatten(done.job)
    said = [t for e in done.report if e.status == "mapped" for t in _shell_words(e.detail)
            if re.fullmatch(r"[a-z_]+(\.[a-z_]+)*=.+", t) and t.split("=")[0] in got]
    assert said, [e.line() for e in done.report]
    for text in said:
        key = text.split("=", 1)[0]
        composed = OmegaConf.to_container(compose_dict([f"cluster={done.job.cluster.name}", text]), resolve=False)
        for part in key.split("."):
            composed = composed[part]
        # nodes and GPUs per node: the torchrun line's (the recipe may spread them); null: the derived default the
        # recipe writes for a value equal to it (max_position_embeddings = seq_length)
        if key not in ("nodes", "cluster.gpus_per_node") and got[key] is not None:
            assert composed == got[key], (text, composed, got[key])
    if script == "list_flags.sh":
        assert {"train.recompute_modules=[core_attn,mlp]", "train.cuda_graph_modules=[attn]",
                "data.blend=[0.5,/data/a_text_document,0.5,/data/b_text_document]"} <= set(said), said
