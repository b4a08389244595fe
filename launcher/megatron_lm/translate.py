"""Megatron-LM ``pretrain_gpt.py`` arguments -> our fields: ``to_fields`` (import; the export direction,
``to_args``, is ``launcher.megatron_lm.export``). One room (~630 lines): the rules that several arguments decide
together, in the order validate_args applies them, each reading what the ones before it decided.

Both directions read ``table.FLAGS`` for the one-argument-one-field cases; the functions here handle the fields
that several arguments decide together. Import starts from what Megatron-LM does when an argument is absent
(``Flag.default``, and its ``validate_args`` rules spelled out below), so the imported job trains what the
script trained, not our defaults. Every argument ends up in exactly one report entry: mapped, ignored (with why)
or unsupported (with why).

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import ast
import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from launcher.megatron_lm.table import FLAGS, IGNORED, REQUIRED, UNREAD, UNSUPPORTED, Flag, typed_override
from launcher.schema import (FP8_FORMATS, FP8_RECIPES, JobConfig, MOE_LOAD_BALANCING, Recompute, SECTIONS, Schedule)

GPT2_BPE_VOCAB = 50257
"""Megatron-LM's GPT2BPETokenizer vocabulary (the GPT-2 encoder.json), used when --vocab-size is absent."""


class ImportError_(Exception):
    """The arguments do not describe a job (a required argument missing, a value that does not parse)."""


@dataclass
class Entry:
    """What became of one argument."""

    flag: str
    text: str
    """The argument as given (flag and values)."""
    status: str
    """mapped, ignored or unsupported."""
    detail: str
    """mapped: the fields it set; ignored / unsupported: why."""

    def line(self) -> str:
        return f"{self.status:<11} {self.text:<48} {self.detail}"


@dataclass
class Args:
    """A parsed pretrain_gpt.py argument list: flags in order, the last of a repeated flag wins (argparse)."""

    items: List[Tuple[str, List[str]]]
    used: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    """flag -> (status, detail) for every flag a rule consumed."""
    notes: List[Entry] = field(default_factory=list)
    """Findings about arguments that are absent (a Megatron-LM default we do not share)."""

    @classmethod
    def parse(cls, argv: List[str]) -> "Args":
        items: List[Tuple[str, List[str]]] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if token.startswith("--") and "=" in token:
                flag, value = token.split("=", 1)
                items.append((flag, [value]))
            elif token.startswith("--"):
                values = []
                while i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i])
                    i += 1
                items.append((token, values))
            else:
                items.append(("", [token]))
        return cls(items)

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.items)

    def values(self, flag: str) -> Optional[List[str]]:
        found = [v for f, v in self.items if f == flag]
        return found[-1] if found else None

    def get(self, flag: str) -> Optional[str]:
        vals = self.values(flag)
        return vals[0] if vals else None

    def use(self, flag: str, detail: str, status: str = "mapped") -> None:
        if self.has(flag) and flag not in self.used:
            self.used[flag] = (status, detail)

    def note(self, flag: str, status: str, detail: str) -> None:
        self.notes.append(Entry(flag, f"({flag} absent)", status, detail))

    def report(self) -> List[Entry]:
        """One entry per argument given (repeats noted), then the notes about absent ones."""
        out, seen = [], {}
        for flag, vals in self.items:
            seen[flag] = seen.get(flag, 0) + 1
        done = set()
        for flag, vals in self.items:
            if flag in done:
                continue
            done.add(flag)
            text = " ".join([flag or "(value)"] + [shlex.quote(v) for v in self.values(flag) or vals])
            if not flag:
                out.append(Entry(flag, text, "unsupported", "a value without an argument name"))
                continue
            status, detail = self.used.get(flag) or _unused(flag)
            if seen[flag] > 1:
                detail += f" (given {seen[flag]} times; the last one counts, as in Megatron-LM)"
            out.append(Entry(flag, text, status, detail))
        return out + self.notes


def _unused(flag: str) -> Tuple[str, str]:
    if flag in IGNORED:
        return "ignored", IGNORED[flag]
    if flag in UNSUPPORTED:
        return "unsupported", UNSUPPORTED[flag]
    return "unsupported", "no equivalent in this launcher (not in launcher/megatron_lm/table.py)"


def _field_type(dotted: str) -> str:
    section, _, name = dotted.rpartition(".")
    cls = SECTIONS[section] if section else JobConfig
    return str(cls.__dataclass_fields__[name].type)


def typed(dotted: str, text: str) -> Any:
    """Megatron text -> the Python value our field holds."""
    kind = _field_type(dotted)
    try:
        if "bool" in kind:
            return text.lower() in ("1", "true", "yes")
        if "int" in kind:
            number = float(text)
            if not number.is_integer():
                raise ValueError(text)
            return int(number)
        if "float" in kind:
            return float(text)
    except ValueError:
        raise ImportError_(f"{dotted}: {text!r} is not a number") from None
    return text


# ---------------------------------------------------------------------------------------------- import


@dataclass(frozen=True)
class Launch:
    """What the launcher command around pretrain_gpt.py said (torchrun / srun), and the exported environment."""

    nodes: int = 1
    gpus_per_node: Optional[int] = None
    env: Tuple[Tuple[str, str], ...] = ()


def to_fields(argv: List[str], launch: Launch = Launch()) -> Tuple[Dict[str, Any], List[Entry]]:
    """The job's fields (dotted -> value) that the arguments decide, and the report of every argument."""
    args, v = Args.parse(argv), {}
    v["nodes"] = launch.nodes
    if launch.gpus_per_node:
        v["cluster.gpus_per_node"] = launch.gpus_per_node
    _gates(args, v)
    _activation_offload(args, v)  # before the flags: its fraction and size are read only with it on
    for f in FLAGS:
        _simple(args, v, f)
    for rule in (_model_shape, _moe, _layout, _precision, _batches, _schedule, _recompute, _cuda_graph_modules, _data,
                 _checkpoint):
        rule(args, v)
    env = dict(launch.env)
    if "WANDB_MODE" in env:
        v["logging.wandb_mode"] = env["WANDB_MODE"]
    return v, args.report()


def _simple(args: Args, v: dict, f: Flag) -> None:
    if args.has(f.flag) and not f.when(v):
        args.use(f.flag, f"not read {UNREAD.get(f.when, 'for this job')}", "ignored")
    elif args.has(f.flag):
        if f.switch is not None:
            if args.values(f.flag):
                raise ImportError_(f"{f.flag} takes no value (got {' '.join(args.values(f.flag))})")
            value = f.switch
        else:
            text = args.get(f.flag)
            if text is None:
                raise ImportError_(f"{f.flag} needs a value")
            value = f.parse(text) if f.parse else typed(f.field, text)
        v[f.field] = value
        args.use(f.flag, typed_override(f.field, value))
    elif f.default is REQUIRED:
        raise ImportError_(f"{f.flag} is required by Megatron-LM and missing")
    elif f.when(v):
        v[f.field] = f.default


def _need(args: Args, flag: str, dotted: str) -> Any:
    text = args.get(flag)
    if text is None:
        raise ImportError_(f"{flag} is required by Megatron-LM and missing")
    return typed(dotted, text)


def _gates(args: Args, v: dict) -> None:
    """Fields other rules depend on: position embedding, dtype and FP8, virtual pipeline, data kind."""
    kind = args.get("--position-embedding-type") or (
        "rope" if args.has("--use-rotary-position-embeddings") else "learned_absolute")
    ours = kind if kind in ("rope", "learned_absolute", "none") else "rope"
    v["model.position_embedding"] = ours
    if ours == kind:
        args.use("--position-embedding-type", f"model.position_embedding={ours}")
    else:
        args.use("--position-embedding-type", f"{kind} position embeddings are not supported; imported as rope",
                 "unsupported")
    args.use("--use-rotary-position-embeddings", "model.position_embedding=rope")
    # MLA's rotary type: our ranks build plain rope (Megatron-LM's MLA default is yarn)
    if args.get("--rope-type") == "rope":
        args.use("--rope-type", "plain rope, as our MLA ranks build it")
    else:
        args.use("--rope-type", f"{args.get('--rope-type')} rotary embeddings are not supported; imported as rope",
                 "unsupported")
    if ours == "rope":
        args.use("--no-position-embedding", "no effect with rope (deprecated in Megatron-LM)", "ignored")
    else:
        args.use("--no-position-embedding", "Megatron-LM refuses it without rope", "unsupported")

    dtype = "bf16" if args.has("--bf16") else "fp16" if args.has("--fp16") else "fp32"
    v["precision.dtype"] = dtype
    args.use("--bf16", "precision.dtype=bf16")
    args.use("--fp16", "precision.dtype=fp16")
    fp8_format, recipe = args.get("--fp8-format"), args.get("--fp8-recipe") or "delayed"
    if fp8_format:
        if recipe not in FP8_RECIPES:
            args.use("--fp8-recipe", f"FP8 recipes here: {', '.join(FP8_RECIPES)}", "unsupported")
            recipe = "delayed"
        if fp8_format not in FP8_FORMATS:
            args.use("--fp8-format", f"FP8 formats here: {', '.join(FP8_FORMATS)}", "unsupported")
            fp8_format = "hybrid"
        v["precision.fp8"], v["precision.fp8_format"] = recipe, fp8_format
        args.use("--fp8-format", f"precision.fp8={recipe} precision.fp8_format={fp8_format}")
        args.use("--fp8-recipe", f"precision.fp8={recipe}")
    else:
        v["precision.fp8"] = None
        args.use("--fp8-recipe", "FP8 is off without --fp8-format (Megatron-LM's rule)", "ignored")

    num_layers = _need(args, "--num-layers", "model.num_layers")
    pp = int(args.get("--pipeline-model-parallel-size") or 1)
    vpp, layout = None, args.get("--pipeline-model-parallel-layout")
    v["parallel.pipeline_model_parallel_layout"] = layout
    if layout:
        from launcher.core.layout import layout_virtual_size
        from launcher.schema import ParallelConfig
        vpp = layout_virtual_size(ParallelConfig(pipeline=pp, pipeline_model_parallel_layout=layout))
        args.use("--pipeline-model-parallel-layout", f"parallel.pipeline_model_parallel_layout={layout} "
                                                     f"parallel.virtual_pipeline={vpp}")
        for flag in ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"):
            args.use(flag, "Megatron-LM refuses it with --pipeline-model-parallel-layout", "unsupported")
    elif args.has("--num-virtual-stages-per-pipeline-rank"):
        vpp = _need(args, "--num-virtual-stages-per-pipeline-rank", "parallel.virtual_pipeline")
        args.use("--num-virtual-stages-per-pipeline-rank", f"parallel.virtual_pipeline={vpp}")
    elif args.has("--num-layers-per-virtual-pipeline-stage"):
        per_chunk = int(args.get("--num-layers-per-virtual-pipeline-stage") or 0)
        per_stage = num_layers // max(1, pp)
        if per_chunk <= 0 or num_layers % max(1, pp) or per_stage % per_chunk:
            raise ImportError_(f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the "
                               f"{per_stage} layers per pipeline stage")
        vpp = per_stage // per_chunk
        args.use("--num-layers-per-virtual-pipeline-stage",
                 f"parallel.virtual_pipeline={vpp} ({per_stage} layers per stage / {per_chunk})")
    v["parallel.virtual_pipeline"] = vpp if vpp and vpp > 1 else None

    if args.has("--mock-data"):
        v["data.kind"] = "mock"
        args.use("--mock-data", "data.kind=mock")
        if args.has("--data-path"):
            args.use("--data-path", "Megatron-LM uses mock data when --mock-data is given", "ignored")
    elif args.has("--data-path"):
        v["data.kind"] = "indexed"
    else:
        v["data.kind"] = "mock"
        args.note("--data-path", "mapped", "neither --data-path nor --mock-data: data.kind=mock")


def _model_shape(args: Args, v: dict) -> None:
    h, heads = v["model.hidden_size"], v["model.num_attention_heads"]
    swiglu, squared = args.has("--swiglu"), args.has("--squared-relu")
    v["model.activation"] = "swiglu" if swiglu else "squared_relu" if squared else "gelu"
    args.use("--swiglu", "model.activation=swiglu")
    args.use("--squared-relu", "model.activation=squared_relu")
    if args.has("--ffn-hidden-size"):
        v["model.ffn_hidden_size"] = _need(args, "--ffn-hidden-size", "model.ffn_hidden_size")
        args.use("--ffn-hidden-size", f"model.ffn_hidden_size={v['model.ffn_hidden_size']}")
    else:  # Megatron-LM's validate_args default
        v["model.ffn_hidden_size"] = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
    if args.has("--group-query-attention"):
        groups = int(args.get("--num-query-groups") or 1)
        v["model.num_query_groups"] = None if groups == heads else groups
        args.use("--group-query-attention", f"model.num_query_groups={groups}")
        args.use("--num-query-groups", f"model.num_query_groups={groups}")
    else:
        v["model.num_query_groups"] = None
        args.use("--num-query-groups", "without --group-query-attention Megatron-LM uses all heads (MHA)",
                 "ignored")
    if v.get("model.kv_channels") == h // heads:
        v["model.kv_channels"] = None  # the same as null: hidden / heads
    seq = v["model.seq_length"]
    max_pos = _need(args, "--max-position-embeddings", "model.max_position_embeddings")
    v["model.max_position_embeddings"] = None if max_pos == seq else max_pos
    args.use("--max-position-embeddings", f"model.max_position_embeddings={max_pos}")
    if args.has("--vocab-size"):
        v["model.vocab_size"] = _need(args, "--vocab-size", "model.vocab_size")
        args.use("--vocab-size", f"model.vocab_size={v['model.vocab_size']}")
    elif args.get("--tokenizer-type") == "GPT2BPETokenizer" or (
            args.get("--tokenizer-type") is None and args.has("--vocab-file") and args.has("--merge-file")):
        v["model.vocab_size"] = GPT2_BPE_VOCAB
        args.note("--vocab-size", "mapped", f"model.vocab_size={GPT2_BPE_VOCAB} (GPT-2 BPE vocab and merges files)")


def parse_layer_pattern(text: str) -> List[int]:
    """Megatron-LM's --moe-layer-freq list form ("([0]*3+[1]*58)", "[1,0,1,0]"), evaluated without eval."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ImportError_(f"--moe-layer-freq {text!r}: only lists, + and * are understood")
    value = ev(ast.parse(text.strip(), mode="eval"))
    if not isinstance(value, list) or any(x not in (0, 1) for x in value):
        raise ImportError_(f"--moe-layer-freq {text!r}: expected a list of 0/1")
    return value


def freq_and_dense(pattern: List[int]) -> Optional[Tuple[int, int]]:
    """(moe_layer_freq, moe_first_k_dense) whose rule (i >= k and i % freq == 0) gives ``pattern``, or None."""
    n = len(pattern)
    for k in range(n + 1):
        for freq in range(1, n + 1):
            if [int(i >= k and i % freq == 0) for i in range(n)] == pattern:
                return freq, k
    return None


def layer_pattern_text(num_layers: int, freq: int, first_k: int) -> str:
    """Our (freq, first_k) as Megatron-LM's --moe-layer-freq: an int when first_k is 0, else a list form."""
    if first_k == 0:
        return str(freq)
    pattern = [int(i >= first_k and i % freq == 0) for i in range(num_layers)]
    if freq == 1:
        return f"([0]*{first_k}+[1]*{num_layers - first_k})"
    return "[" + ",".join(map(str, pattern)) + "]"


def _moe(args: Args, v: dict) -> None:
    for flag in ("--moe-ffn-hidden-size", "--moe-layer-freq", "--moe-aux-loss-coeff",
                 "--moe-router-load-balancing-type"):
        if not v.get("model.num_experts"):
            args.use(flag, "no effect without --num-experts", "ignored")
    if not v.get("model.num_experts"):
        v["model.num_experts"] = None
        return
    if args.has("--moe-ffn-hidden-size"):
        size = _need(args, "--moe-ffn-hidden-size", "model.moe_ffn_hidden_size")
        v["model.moe_ffn_hidden_size"] = None if size == v["model.ffn_hidden_size"] else size
        args.use("--moe-ffn-hidden-size", f"model.moe_ffn_hidden_size={size}")
    else:
        v["model.moe_ffn_hidden_size"] = None
    text = args.get("--moe-layer-freq") or "1"
    if text.strip().lstrip("-").isdigit():
        freq, first_k = int(text), 0
    else:
        pattern = parse_layer_pattern(text)
        if len(pattern) != v["model.num_layers"]:
            raise ImportError_(f"--moe-layer-freq has {len(pattern)} entries for {v['model.num_layers']} layers")
        found = freq_and_dense(pattern)
        if found is None:
            args.use("--moe-layer-freq", "only 'every n-th layer after the first k' patterns", "unsupported")
            found = (1, 0)
        freq, first_k = found
    v["model.moe_layer_freq"], v["model.moe_first_k_dense"] = freq, first_k
    args.use("--moe-layer-freq", f"model.moe_layer_freq={freq} model.moe_first_k_dense={first_k}")
    coeffs = args.values("--moe-aux-loss-coeff") or ["0.0"]
    v["model.moe_aux_loss_coeff"] = float(coeffs[0])
    if len(coeffs) > 1:
        args.use("--moe-aux-loss-coeff", "one load-balancing coefficient only", "unsupported")
    args.use("--moe-aux-loss-coeff", f"model.moe_aux_loss_coeff={coeffs[0]}")
    kinds = args.values("--moe-router-load-balancing-type") or ["aux_loss"]
    if kinds[0] not in MOE_LOAD_BALANCING or len(kinds) > 1:
        args.use("--moe-router-load-balancing-type", f"one of {', '.join(MOE_LOAD_BALANCING)}", "unsupported")
    else:
        v["model.moe_router_load_balancing_type"] = kinds[0]
        args.use("--moe-router-load-balancing-type", f"model.moe_router_load_balancing_type={kinds[0]}")


def _layout(args: Args, v: dict) -> None:
    if v.get("parallel.expert_tensor") == v["parallel.tensor"]:
        v["parallel.expert_tensor"] = None  # the same as null: the tensor-parallel size
    strategy = args.get("--data-parallel-sharding-strategy") or "optim_grads_params"
    if strategy == "optim_grads_params":
        args.use("--data-parallel-sharding-strategy", "optim_grads_params, the one parallel.megatron_fsdp uses")
    else:
        args.use("--data-parallel-sharding-strategy", "Megatron FSDP here shards optimizer state, gradients and "
                                                      "parameters (optim_grads_params) only", "unsupported")
    vpp = v["parallel.virtual_pipeline"]
    v["schedule.kind"] = Schedule.INTERLEAVED if vpp else Schedule.ONE_F_ONE_B
    if vpp:
        v["schedule.overlap_p2p_comm"] = not args.has("--no-overlap-p2p-communication")
        args.use("--no-overlap-p2p-communication", "schedule.overlap_p2p_comm=false")
    else:  # Megatron-LM turns p2p overlap off without interleaving
        v["schedule.overlap_p2p_comm"] = False
        args.use("--no-overlap-p2p-communication", "no effect without interleaving", "ignored")


def _precision(args: Args, v: dict) -> None:
    if v["precision.dtype"] != "fp32" and not args.has("--attention-softmax-in-fp32"):
        args.note("--attention-softmax-in-fp32", "ignored", "Megatron-LM's unfused attention would take the "
                  "softmax in the model dtype; here it is fp32 (Transformer Engine's fused attention: either way)")
    if v["precision.dtype"] == "bf16":  # Megatron-LM reduces bf16 gradients in fp32 unless told otherwise
        v["precision.grad_reduce_in_fp32"] = not args.has("--grad-reduce-in-bf16")
        args.use("--grad-reduce-in-bf16", "precision.grad_reduce_in_fp32=false")
        args.use("--accumulate-allreduce-grads-in-fp32", "precision.grad_reduce_in_fp32=true")
    else:
        v["precision.grad_reduce_in_fp32"] = args.has("--accumulate-allreduce-grads-in-fp32")
        args.use("--accumulate-allreduce-grads-in-fp32", "precision.grad_reduce_in_fp32=true")
        args.use("--grad-reduce-in-bf16", "no effect without --bf16", "ignored")


def _batches(args: Args, v: dict) -> None:
    mbs = v["train.micro_batch_size"]
    world = v["nodes"] * (v.get("cluster.gpus_per_node") or 8)
    dp = max(1, world // max(1, v["parallel.tensor"] * v["parallel.pipeline"] * v["parallel.context"]))
    gbs = int(args.get("--global-batch-size") or mbs * dp)
    v["train.global_batch_size"] = gbs
    args.use("--global-batch-size", f"train.global_batch_size={gbs}")
    if args.has("--train-iters"):
        steps = _need(args, "--train-iters", "train.train_steps")
        args.use("--train-iters", f"train.train_steps={steps}")
    elif args.has("--train-samples"):
        steps = _need(args, "--train-samples", "train.train_steps") // gbs
        args.use("--train-samples", f"train.train_steps={steps} (samples // global batch, as Megatron-LM)")
    else:
        raise ImportError_("Megatron-LM needs --train-iters or --train-samples")
    v["train.train_steps"], v["train.train_tokens"] = steps, None

    def iters(flag_iters: str, flag_samples: str) -> Optional[int]:
        if args.has(flag_iters):
            return int(float(args.get(flag_iters) or 0))
        if args.has(flag_samples):
            return int(float(args.get(flag_samples) or 0)) // gbs
        return None

    decay = iters("--lr-decay-iters", "--lr-decay-samples")
    for flag in ("--lr-decay-iters", "--lr-decay-samples"):
        if decay is None or decay == steps:
            args.use(flag, f"the LR decays over the whole run (train.train_steps={steps})")
        else:
            args.use(flag, f"the LR decays over the whole run here (train.train_steps={steps}), not {decay} "
                           "steps", "unsupported")
    warmup = iters("--lr-warmup-iters", "--lr-warmup-samples")
    if args.has("--lr-warmup-fraction"):
        warmup = int(float(args.get("--lr-warmup-fraction") or 0) * (decay or steps))
        args.use("--lr-warmup-fraction", f"train.warmup_steps={warmup} (fraction x decay steps)")
    v["train.warmup_steps"] = warmup or 0
    args.use("--lr-warmup-iters", f"train.warmup_steps={warmup}")
    args.use("--lr-warmup-samples", f"train.warmup_steps={warmup} (samples // global batch)")


def _schedule(args: Args, v: dict) -> None:
    style = args.get("--lr-decay-style") or "linear"
    ours = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd"}.get(style)
    if ours is None:
        args.use("--lr-decay-style", f"{style} decay is not supported (cosine, linear, constant, WSD)",
                 "unsupported")
        ours = "cosine"
    args.use("--lr-decay-style", f"train.lr_schedule={ours}")
    v["train.lr_schedule"] = ours
    steps = v["train.train_steps"]
    if ours == "wsd":
        decay = args.get("--lr-wsd-decay-iters")
        if decay is None and args.has("--lr-wsd-decay-samples"):
            decay = str(int(float(args.get("--lr-wsd-decay-samples") or 0)) // v["train.global_batch_size"])
        n = int(float(decay)) if decay is not None else None
        v["train.wsd_decay_steps"] = None if n is None or n == max(1, steps // 10) else n
        args.use("--lr-wsd-decay-iters", f"train.wsd_decay_steps={n}")
        args.use("--lr-wsd-decay-samples", f"train.wsd_decay_steps={n}")
        shape = args.get("--lr-wsd-decay-style") or "exponential"
        if shape == "linear":
            args.use("--lr-wsd-decay-style", "linear, as here")
        elif args.has("--lr-wsd-decay-style"):
            args.use("--lr-wsd-decay-style", "the WSD decay phase is linear here", "unsupported")
        else:
            args.note("--lr-wsd-decay-style", "unsupported",
                      "Megatron-LM's default WSD decay is exponential; it is linear here")
    else:
        for flag in ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples", "--lr-wsd-decay-style"):
            args.use(flag, "no effect without --lr-decay-style WSD", "ignored")


def _cuda_graph_modules(args: Args, v: dict) -> None:
    """--cuda-graph-modules (or its deprecated name --cuda-graph-scope) -> train.cuda_graph_modules; Megatron-LM's
    "full" is the whole layer, our empty list."""
    for flag in ("--cuda-graph-modules", "--cuda-graph-scope"):
        modules = args.values(flag)
        if modules is None:
            continue
        v["train.cuda_graph_modules"] = [] if modules == ["full"] else list(modules)
        args.use(flag, typed_override("train.cuda_graph_modules", v["train.cuda_graph_modules"]))


def _activation_offload(args: Args, v: dict) -> None:
    """--fine-grained-activation-offloading with --offload-modules -> train.activation_offload_modules (our switch is
    a non-empty list). Megatron-Core asserts the switch has modules; the modules alone are not read."""
    on, modules = args.has("--fine-grained-activation-offloading"), args.values("--offload-modules")
    if on and args.values("--fine-grained-activation-offloading"):
        raise ImportError_("--fine-grained-activation-offloading takes no value "
                           f"(got {' '.join(args.values('--fine-grained-activation-offloading'))})")
    if on and modules:
        v["train.activation_offload_modules"] = list(modules)
        override = typed_override("train.activation_offload_modules", list(modules))
        args.use("--fine-grained-activation-offloading", override)
        args.use("--offload-modules", override)
    elif on:
        args.use("--fine-grained-activation-offloading", "Megatron-Core asserts offload_modules is not empty "
                 "(transformer_config.py); give --offload-modules", "unsupported")
    else:
        args.use("--offload-modules", "not read without --fine-grained-activation-offloading", "ignored")


def _recompute(args: Args, v: dict) -> None:
    granularity = args.get("--recompute-granularity") or ("selective" if args.has("--recompute-activations")
                                                           else None)
    args.use("--recompute-activations", "train.recompute=selective")
    v["train.recompute"] = granularity or "none"
    v["train.recompute_num_layers"] = None
    if granularity not in (None, Recompute.SELECTIVE, Recompute.FULL):
        args.use("--recompute-granularity", f"{granularity}: none, selective or full", "unsupported")
        v["train.recompute"] = "none"
        return
    args.use("--recompute-granularity", f"train.recompute={v['train.recompute']}")
    modules = args.values("--recompute-modules")
    if "train.recompute_modules" in flatten(JobConfig()):
        if granularity == Recompute.SELECTIVE:
            v["train.recompute_modules"] = [] if modules in (None, ["core_attn"]) else list(modules)
            args.use("--recompute-modules", typed_override("train.recompute_modules", v["train.recompute_modules"]))
        args.use("--recompute-modules", "only selective recompute reads it", "ignored")
    if granularity != Recompute.FULL:
        for flag in ("--recompute-method", "--recompute-num-layers"):
            args.use(flag, "only full recompute reads it", "ignored")
        return
    method = args.get("--recompute-method")
    n = int(args.get("--recompute-num-layers") or 1)
    if method == "uniform":
        v["train.recompute_num_layers"] = None if n == 1 else n
        args.use("--recompute-method", "uniform, as here")
        args.use("--recompute-num-layers", f"train.recompute_num_layers={n}")
    else:
        args.use("--recompute-method", "full recompute here is uniform (--recompute-method uniform)",
                 "unsupported")
        args.use("--recompute-num-layers", "full recompute here is uniform", "unsupported")


def _data(args: Args, v: dict) -> None:
    kind = v["data.kind"]
    kind_flags = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")
    if kind == "mock":
        for flag in kind_flags:
            args.use(flag, "mock data has no tokenizer", "ignored")
        args.use("--split", "mock data has no splits", "ignored")
        v["data.blend"], v["data.tokenizer"] = [], None
        return
    blend = [_number_or_text(x) for x in (args.values("--data-path") or [])]
    v["data.blend"] = blend
    args.use("--data-path", "data.kind=indexed " + typed_override("data.blend", blend))
    kind_of = args.get("--tokenizer-type")
    if kind_of == "HuggingFaceTokenizer" and args.get("--tokenizer-model"):
        v["data.tokenizer"] = args.get("--tokenizer-model")
        args.use("--tokenizer-type", "Hugging Face tokenizers are the kind read here (data.tokenizer)")
        args.use("--tokenizer-model", f"data.tokenizer={v['data.tokenizer']} (must be a tokenizer.json)")
    else:
        v["data.tokenizer"] = None
        args.use("--tokenizer-type", f"{kind_of}: only HuggingFaceTokenizer with a tokenizer.json "
                                     "(data.tokenizer=PATH)", "unsupported")
        args.use("--tokenizer-model", "only a HuggingFaceTokenizer tokenizer.json", "unsupported")


def _number_or_text(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def _checkpoint(args: Args, v: dict) -> None:
    save, load = args.get("--save"), args.get("--load")
    v["checkpoint.load"] = None
    if save and load and save != load:
        v["checkpoint.dir"], v["checkpoint.resume"], v["checkpoint.load"] = save, True, load
        args.use("--save", f"checkpoint.dir={save}")
        args.use("--load", f"checkpoint.load={load} (start from it; this run's own checkpoints in "
                           "checkpoint.dir take precedence once it has some)")
    elif save or load:
        v["checkpoint.dir"] = save or load
        v["checkpoint.resume"] = load is not None
        args.use("--save", f"checkpoint.dir={save}")
        args.use("--load", f"checkpoint.dir={load} checkpoint.resume=true")
    v["logging.tensorboard"] = args.has("--tensorboard-dir")
    args.use("--tensorboard-dir", "logging.tensorboard=true (events go into the run bundle)")


def flatten(job: JobConfig) -> Dict[str, Any]:
    """dotted field -> value, for every field of the job."""
    out = {}
    for f in dataclasses.fields(job):
        value = getattr(job, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                out[f"{f.name}.{g.name}"] = getattr(value, g.name)
        else:
            out[f.name] = value
    return out
