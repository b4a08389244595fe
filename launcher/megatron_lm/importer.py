"""Import a Megatron-LM job: record its command line, translate it, write a recipe, validate and plan it.

A launch script is run by bash with stand-in ``torchrun``, ``python``, ``python3``, ``srun`` and ``sbatch`` first
on ``PATH``: they record their arguments and environment and run nothing, so variables, arrays, ``$(...)``,
conditionals and continuations expand exactly as the user's shell expands them. The script runs in an empty
temporary directory (holding an empty ``pretrain_gpt.py`` for scripts that check it exists), with a time limit.
A plain file of arguments is split as the shell would (quotes, comments, continuations), without running anything.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from launcher import RECIPES_DIR
from launcher.core import cuda_env
from launcher.megatron_lm.translate import Entry, ImportError_, Launch, flatten, to_fields

STANDINS = ("torchrun", "python", "python3", "srun", "sbatch", "mpirun")
RECORDER = """#!/bin/sh
# Stand-in installed by `python -m launcher import`: records its command line and environment, runs nothing.
stamp="$(date +%s%N)-$$"
printf '%s\\0' "$(basename "$0")" "$@" > "$MLM_RECORD_DIR/$stamp.argv"
env -0 > "$MLM_RECORD_DIR/$stamp.env"
"""
SCRIPT_TIMEOUT_S = 60
SHELL_VARS = {"PATH", "PWD", "OLDPWD", "SHLVL", "_", "MLM_RECORD_DIR"}


@dataclass
class Command:
    """The recorded pretrain_gpt.py command: its arguments and what launched it."""

    program: str
    args: List[str]
    launch: Launch
    source: str
    launcher: List[str] = ()
    """What ran pretrain_gpt.py: srun / torchrun / python and their options."""


def record_script(path: Path, script_args: List[str] = ()) -> List[Tuple[List[str], Dict[str, str]]]:
    """Run a launch script with the stand-ins; every recorded (argv, environment), in order."""
    with tempfile.TemporaryDirectory(prefix="mlm-import-") as tmp:
        tmp_path = Path(tmp)
        bin_dir, rec_dir, work = tmp_path / "bin", tmp_path / "records", tmp_path / "work"
        for d in (bin_dir, rec_dir, work):
            d.mkdir()
        for name in STANDINS:
            (bin_dir / name).write_text(RECORDER)
            (bin_dir / name).chmod(0o755)
        (work / "pretrain_gpt.py").write_text("")
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", MLM_RECORD_DIR=str(rec_dir))
        try:
            done = subprocess.run(["bash", str(path.resolve()), *script_args], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ImportError_(f"{path}: still running after {SCRIPT_TIMEOUT_S} s with stand-in launchers") from None
        # The script runs in a scratch directory (whatever it creates stays there), but it was written to run from
        # the directory `import` is called from: a path it built from $PWD / $(pwd) names that directory, not the
        # scratch one, which is deleted on return (recorded into a recipe, it would name nothing).
        here = os.getcwd()

        def moved(text: str) -> str:
            for scratch in dict.fromkeys((str(work), os.path.realpath(work))):
                text = text.replace(scratch, here)
            return text

        records = []
        for argv_file in sorted(rec_dir.glob("*.argv"), key=lambda p: p.name):
            argv = argv_file.read_bytes().split(b"\0")[:-1]
            env_items = argv_file.with_suffix(".env").read_bytes().split(b"\0")
            rec_env = {k: moved(v) for k, v in (item.decode().split("=", 1) for item in env_items if b"=" in item)}
            records.append(([moved(a.decode()) for a in argv], rec_env))
        if not records:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ImportError_(f"{path}: ran (exit {done.returncode}) without calling torchrun, python or srun "
                               f"({tail[0]})")
        return records


def read_args_file(path: Path) -> List[str]:
    """A file of arguments, split as the shell would (quotes, # comments, backslash continuations)."""
    text = path.read_text().replace("\\\n", " ")
    return shlex.split(text, comments=True)


def _is_program(token: str) -> bool:
    return token.endswith(".py") and Path(token).name.startswith("pretrain")


def find_command(argv: List[str], env: Dict[str, str], source: str, sbatch_nodes: Optional[int]) -> Optional[Command]:
    """The pretrain program and the launcher arguments before it, from one recorded command line."""
    at = next((i for i, t in enumerate(argv) if _is_program(t)), None)
    if at is None:
        return None
    before = argv[:at]
    nodes = _option(before, ("--nnodes", "-N", "--nodes")) or (str(sbatch_nodes) if sbatch_nodes else None)
    per_node = _option(before, ("--nproc_per_node", "--nproc-per-node", "--ntasks-per-node", "--gpus-per-node"))
    exported = {k: val for k, val in env.items() if k not in SHELL_VARS and os.environ.get(k) != val
                and not k.startswith("BASH_FUNC")}
    launch = Launch(nodes=_count(nodes, 1), gpus_per_node=_count(per_node, None) if per_node else None,
                    env=tuple(sorted(exported.items())))
    return Command(argv[at], argv[at + 1:], launch, source, before)


def _option(tokens: List[str], names: Tuple[str, ...]) -> Optional[str]:
    """The value of the first of ``names`` (in priority order: torchrun's before srun's) among ``tokens``."""
    for name in names:
        for i, token in enumerate(tokens):
            if token == name and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return None


def _count(text: Optional[str], default: Optional[int]) -> Optional[int]:
    """A node or process count as torchrun/srun accept it ("2", "1:4" elastic -> the maximum)."""
    if text is None:
        return default
    match = re.fullmatch(r"(\d+)(?::(\d+))?", text.strip())
    if not match:
        raise ImportError_(f"node/process count {text!r} is not a number (is a variable unset?)")
    return int(match.group(2) or match.group(1))


def load_command(source: Path, script_args: List[str] = ()) -> Command:
    """The Megatron-LM command of a launch script or an arguments file."""
    text = source.read_text(errors="replace")
    sbatch = re.search(r"^#SBATCH\s+(?:--nodes[= ]|-N\s*)(\d+)", text, re.M)
    sbatch_nodes = int(sbatch.group(1)) if sbatch else None
    if text.startswith("#!") or source.suffix in (".sh", ".bash", ".sbatch", ".slurm"):
        commands = [c for argv, env in record_script(source, list(script_args))
                    if (c := find_command(argv, env, str(source), sbatch_nodes))]
    else:
        tokens = read_args_file(source)
        found = find_command(tokens, dict(os.environ), str(source), sbatch_nodes)
        commands = [found or Command("pretrain_gpt.py", tokens, Launch(), str(source))]
    if not commands:
        raise ImportError_(f"{source}: no pretrain_*.py command was run")
    if len(commands) > 1:
        raise ImportError_(f"{source}: {len(commands)} pretrain commands ran; import one at a time")
    return commands[0]


# ---------------------------------------------------------------------------------------------- recipe

SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
         "vocab_size", "normalization", "activation", "position_embedding", "tie_embeddings", "add_bias_linear",
         "add_qkv_bias", "qk_layernorm", "num_experts", "multi_latent_attention", "mtp_num_layers")
MOE_SHAPE = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
             "moe_first_k_dense", "moe_router_score_function")
MLA_SHAPE = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""Model fields that make an architecture (parameter shapes and functions); a recipe overrides the rest."""


def canonical(flat: Dict[str, Any]) -> Dict[str, Any]:
    """Spell equivalent values one way: a null that means "derived" and the derived value compare equal."""
    out = dict(flat)
    g = flat.get
    if g("model.hidden_size") and g("model.num_attention_heads"):
        if g("model.kv_channels") == g("model.hidden_size") // g("model.num_attention_heads"):
            out["model.kv_channels"] = None
        if g("model.num_query_groups") == g("model.num_attention_heads"):
            out["model.num_query_groups"] = None
    if g("model.max_position_embeddings") is not None and g("model.max_position_embeddings") == g("model.seq_length"):
        out["model.max_position_embeddings"] = None
    if g("model.moe_ffn_hidden_size") is not None and g("model.moe_ffn_hidden_size") == g("model.ffn_hidden_size"):
        out["model.moe_ffn_hidden_size"] = None
    if g("parallel.expert_tensor") is not None and g("parallel.expert_tensor") == g("parallel.tensor"):
        out["parallel.expert_tensor"] = None
    if g("parallel.virtual_pipeline") == 1:
        out["parallel.virtual_pipeline"] = None
    if g("train.recompute_num_layers") == 1:
        out["train.recompute_num_layers"] = None
    return out


def _model_entries(extra_dir: Optional[Path]) -> Dict[str, Dict[str, Any]]:
    from omegaconf import OmegaConf
    from launcher.schema import ModelConfig
    dirs = [RECIPES_DIR / "model"] + ([extra_dir] if extra_dir and extra_dir != RECIPES_DIR / "model" else [])
    entries = {}
    for d in dirs:
        for path in sorted(d.glob("*.yaml")) if d.is_dir() else []:
            merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
            entries[path.stem] = {f"model.{k}": val for k, val in OmegaConf.to_container(merged).items()}
    return entries


def _shape_keys(flat: Dict[str, Any]) -> List[str]:
    keys = list(SHAPE) + (list(MOE_SHAPE) if flat.get("model.num_experts") else []) \
        + (list(MLA_SHAPE) if flat.get("model.multi_latent_attention") else [])
    return [f"model.{k}" for k in keys]


def match_model(values: Dict[str, Any], extra_dir: Optional[Path]) -> Optional[str]:
    """The model entry whose architecture the imported fields describe (vocab may be unknown), or None."""
    want = canonical(values)
    for name, entry in _model_entries(extra_dir).items():
        have = canonical(entry)
        keys = [k for k in _shape_keys(want) if not (k == "model.vocab_size" and k not in values)]
        if all(have.get(k) == want.get(k) for k in keys) and _shape_keys(have) == _shape_keys(want):
            return name
    return None


def model_entry_yaml(name: str, values: Dict[str, Any], source: str) -> str:
    """A new recipes/model entry: every model field the import decided, with where it came from."""
    import dataclasses
    from launcher.schema import ModelConfig
    lines = [f"# {name}. Source: Megatron-LM arguments of {source} (imported with `python -m launcher import`).",
             f"name: {name}"]
    for f in dataclasses.fields(ModelConfig):  # schema order; what the import decided
        key = f"model.{f.name}"
        if key in values and f.name != "name":
            lines.append(f"{f.name}: {_yaml_scalar(values[key])}")
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    """One YAML value; a literal ``${`` is escaped so that OmegaConf does not read it as an interpolation."""
    import yaml
    if isinstance(value, str):
        value = value.replace("${", "\\${")
    elif isinstance(value, list):
        value = [x.replace("${", "\\${") if isinstance(x, str) else x for x in value]
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


ENV_PREFIXES = ("NCCL_", "CUDA_", "NVTE_", "TORCH_", "PYTORCH_", "OMP_", "UB_", "TRITON_", "CUDNN_", "NVIDIA_",
                "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM")
"""Environment the script exports that is copied into the recipe's cluster.env: tuning of the libraries a rank
uses. Anything else (credentials, paths of the user's shell) is reported and left out."""
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def env_entries(env: Dict[str, str], profile_env: Dict[str, str], secrets: set) -> Tuple[Dict[str, str], List[Entry]]:
    """(variables to set in cluster.env, one report entry per exported variable)."""
    keep, report = {}, []
    for k, val in sorted(env.items()):
        text = f"export {k}={shlex.quote(val)}" if k not in secrets else f"export {k}=..."
        if k == "WANDB_MODE":
            report.append(Entry(k, text, "mapped", f"logging.wandb_mode={val}"))
        elif k in secrets or any(w in k.upper() for w in SECRET_WORDS):
            report.append(Entry(k, f"export {k}=...", "ignored", "a secret: passed by name at run time only "
                                                                  "(cluster.secret_env), never written"))
        elif not k.startswith(ENV_PREFIXES):
            report.append(Entry(k, text, "ignored", "not a library tuning variable; set cluster.env yourself "
                                                    "if the ranks need it"))
        elif profile_env.get(k) == val:
            report.append(Entry(k, text, "mapped", "already in the cluster profile's env"))
        else:
            keep[k] = val
            report.append(Entry(k, text, "mapped", f"cluster.env.{k}"))
    return keep, report


def recipe_yaml(header: List[str], defaults: List[str], body: Dict[str, Any]) -> str:
    """The recipe text: a defaults list and the fields that differ from it, grouped by section."""
    from launcher.schema import SECTIONS
    lines = ["# @package _global_"] + [f"# {h}" for h in header] + ["defaults:"]
    lines += [f"  - {d}" for d in defaults] + ["  - _self_", ""]
    top = {k: val for k, val in body.items() if "." not in k}
    lines += [f"{k}: {_yaml_scalar(val)}" for k, val in top.items()]
    for section in SECTIONS:
        keys = [k for k in body if k.startswith(section + ".")]
        if keys:
            lines.append(f"{section}:")
            for k in keys:
                rest = k[len(section) + 1:]
                if "." in rest:  # free-form dict entries (cluster.env.NAME)
                    outer, inner = rest.split(".", 1)
                    lines.append(f"  {outer}:\n    {inner}: {_yaml_scalar(body[k])}")
                else:
                    lines.append(f"  {rest}: {_yaml_scalar(body[k])}")
    return "\n".join(lines) + "\n"


def compose_from(root: Path, recipe: str, overrides: List[str] = ()):
    """Compose ``recipe`` found under ``root`` (a recipes-like directory: recipe/, model/), as the CLI would."""
    from launcher.config import compose_job
    extra = [] if root.resolve() == RECIPES_DIR.resolve() else [f"hydra.searchpath=[file://{root.resolve()}]"]
    return compose_job(extra + [f"recipe={recipe}", *overrides])


@dataclass
class Imported:
    """The outcome of one import."""

    recipe_path: Path
    model: str
    new_model: Optional[Path]
    report: List[Entry]
    job: Any
    fields: Dict[str, Any]


def import_job(source: Path, *, output: Optional[Path] = None, model_name: Optional[str] = None,
               cluster: Optional[str] = None, name: Optional[str] = None, script_args: List[str] = (),
               extra: Dict[str, Any] = None, force: bool = False) -> Imported:
    """Import ``source`` into a recipe at ``output`` (default recipes/recipe/<stem>.yaml); checks that the written
    recipe composes back to exactly the imported fields. An existing recipe is replaced only with ``force``."""
    stem = _safe(output.stem if output else source.stem)
    output = output or RECIPES_DIR / "recipe" / f"{stem}.yaml"
    if output.parent.name != "recipe" or output.suffix != ".yaml":
        raise ImportError_(f"--output {output}: a recipe is DIR/recipe/NAME.yaml (its model entry goes to "
                           "DIR/model/), e.g. recipes/recipe/NAME.yaml")
    if output.exists() and not force:
        raise ImportError_(f"{output} exists; choose another --output or add --force to replace it")
    shipped = RECIPES_DIR / "recipe" / output.name
    if shipped.exists() and output.resolve().parent.parent != RECIPES_DIR.resolve():
        # Hydra looks in the shipped recipes before any hydra.searchpath entry: recipe=<stem> would be ours
        raise ImportError_(f"--output {output}: {stem} is a shipped recipe, which recipe={stem} would load instead of "
                           f"yours; choose another name, e.g. --output {output.with_name(stem + '_imported.yaml')}")
    command = load_command(source, script_args)
    root = output.resolve().parent.parent
    values, report = to_fields(command.args, _with_gpus(command.launch, cluster))
    values.update({k: val for k, val in (extra or {}).items() if k in values or k.startswith("model.")})
    if command.launcher:
        report.insert(0, Entry("(launcher)", " ".join(shlex.quote(t) for t in command.launcher), "mapped",
                               f"nodes={values['nodes']} cluster.gpus_per_node={values['cluster.gpus_per_node']} "
                               "(rendezvous options: the launcher renders its own)"))
    values["name"] = name or values.get("name") or stem
    if cluster is None:
        cluster = "local" if values.get("cluster.backend") == "gloo" else "h100"
    env = dict(command.launch.env)
    matched = match_model(values, root / "model")
    new_model = None
    if matched is None:
        if "model.vocab_size" not in values:
            raise ImportError_("the vocabulary size is unknown (no --vocab-size, and no model entry matches); "
                               "give it: python -m launcher import ... model.vocab_size=N")
        matched = _safe(model_name or stem)
        new_model = root / "model" / f"{matched}.yaml"
        if new_model.exists() or (RECIPES_DIR / "model" / f"{matched}.yaml").exists():
            raise ImportError_(f"model entry {matched} exists with another architecture; choose --model NAME")
    entries = _model_entries(root / "model")
    if matched in entries and "model.vocab_size" not in values:
        values["model.vocab_size"] = entries[matched]["model.vocab_size"]
        report.append(Entry("--vocab-size", "(--vocab-size absent)", "mapped",
                            f"model.vocab_size={values['model.vocab_size']} from the model entry {matched}"))
    values["model.name"] = matched
    defaults = [f"/model: {matched}"] + (["/data: mock"] if values["data.kind"] == "mock" else []) \
        + [f"override /cluster: {cluster}"]
    program = Path(command.program).name
    header = [f"Imported from {command.source} by `python -m launcher import` (Megatron-LM {program}).",
              f"Model entry: {matched}{' (new)' if new_model else ''}; cluster profile: {cluster}."]
    output.parent.mkdir(parents=True, exist_ok=True)
    body, env_report = _body(values, defaults, root, new_model, env, cluster, source, extra or {})
    report += env_report
    if new_model:
        new_model.parent.mkdir(parents=True, exist_ok=True)
        new_model.write_text(model_entry_yaml(matched, {k: val for k, val in values.items()
                                                          if k.startswith("model.")}, command.source))
    output.write_text(recipe_yaml(header, defaults, body))
    job = compose_from(root, output.stem)
    got = canonical(flatten(job))
    want = canonical({**values, **{k: val for k, val in body.items() if k in values or k in got}})
    wrong = {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    if wrong:
        raise ImportError_(f"the written recipe does not compose back to the import: {wrong}")
    return Imported(output, matched, new_model, report, job, values)


def _with_gpus(launch: Launch, cluster: Optional[str]) -> Launch:
    if launch.gpus_per_node:
        return launch
    from omegaconf import OmegaConf
    profile = RECIPES_DIR / "cluster" / f"{cluster or 'h100'}.yaml"
    gpus = OmegaConf.load(profile).get("gpus_per_node", 8) if profile.exists() else 8
    return Launch(launch.nodes, int(gpus), launch.env)


def _body(values, defaults, root, new_model, env, cluster, source, extra) -> Dict[str, Any]:
    """The recipe's own fields: those the import decided that differ from its defaults list."""
    with tempfile.TemporaryDirectory(prefix="mlm-base-") as tmp:
        base_root = Path(tmp)
        (base_root / "recipe").mkdir()
        (base_root / "recipe" / "_base.yaml").write_text(recipe_yaml([], defaults, {}))
        if new_model:
            (base_root / "model").mkdir()
            (base_root / "model" / new_model.name).write_text(
                model_entry_yaml(values["model.name"], {k: v for k, v in values.items() if k.startswith("model.")},
                                 str(source)))
        from launcher.config import compose_job
        paths = [f"file://{base_root}"] + ([f"file://{root.resolve()}"] if root.resolve() != RECIPES_DIR.resolve()
                                          else [])
        base_job = compose_job([f"hydra.searchpath=[{','.join(paths)}]", "recipe=_base"])
    base = canonical(flatten(base_job))
    want = canonical(values)
    body = {k: values[k] for k in base if k in values and base[k] != want[k]}  # in schema order
    profile_env = dict(base_job.cluster.env)
    if profile_env.get(cuda_env.VAR) == cuda_env.AUTO:  # the value the profile would give this imported job
        job_values = {**flatten(base_job), **values}
        profile_env[cuda_env.VAR] = cuda_env.derived_for(
            gpu=base_job.cluster.gpu, megatron_fsdp=bool(job_values["parallel.megatron_fsdp"]),
            moe_a2a_overlap=bool(job_values["parallel.moe_a2a_overlap"]),
            tensor=int(job_values["parallel.tensor"]), context=int(job_values["parallel.context"]))
    if values.get("train.activation_offload_modules"):  # what the job's environment sets for it (cuda_env.job_env)
        profile_env.setdefault(cuda_env.CPU_OFFLOAD_V1, "1")
    keep, report = env_entries(env, profile_env, set(base_job.cluster.secret_env))
    body.update({f"cluster.env.{k}": val for k, val in keep.items()})
    body.update(extra)
    return body, report


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_").lower() or "imported"
