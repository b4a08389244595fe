"""Multi-token prediction (MTP): the block spec ``GPTModel(mtp_block_spec=...)`` needs.

Setting ``TransformerConfig.mtp_num_layers`` alone is not enough in Megatron-Core 0.19.2: the MTP block is
built only when a spec is passed, yet ``GPTModel._postprocess`` always splits the decoder output into
``1 + mtp_num_layers`` chunks, so without the spec the loss fails with a shape error.

What 0.19.2 does (``models/gpt/gpt_layer_specs.py``, ``transformer/multi_token_prediction.py``):

* ``get_gpt_mtp_block_spec(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None)`` takes the
  decoder *block* spec (it uses its last layer spec as each MTP layer's inner transformer layer) or a single
  ``TransformerLayer`` ModuleSpec, and returns ``MultiTokenPredictionBlockSubmodules`` or None.
* Without a custom ``pipeline_model_parallel_layout`` all MTP layers live on the last pipeline stage and,
  with virtual pipelining, in its last virtual chunk (``get_mtp_num_layers_to_build`` /
  ``mtp_on_this_rank`` use ``is_pipeline_last_stage(ignore_virtual=False, vp_stage)``); elsewhere the
  function returns None. ``MultiTokenPredictionBlock`` asserts the last virtual stage.
* The MTP stage also holds a copy of the word embeddings (tied to the first stage by Megatron itself).
* Loss: ``mtp_loss_scaling_factor`` (default 0.1) / ``mtp_num_layers`` per depth, added to the gradient
  through ``MTPLossAutoScaler`` (the returned loss tensor is the main LM loss only); the pipeline schedules
  set ``MTPLossAutoScaler.set_loss_scale``.

Local (CPU) spec: the local backend's MTP norms (enorm, hnorm, final_layernorm) are ``WrappedTorchNorm``,
which refuses sequence parallelism, so they get the same ``SequenceParallelNorm`` swap as the decoder
(:func:`models.backend._replace_norms`). The training-mode forward also calls ``torch.cuda.current_device()``
in ``multi_token_prediction`` (MTP loss-logging tracker): on CPU that module must be bridged by
``models.cpu_compat`` (see :func:`mtp_supported_on_local_spec`).

Initialisation: the builder reseeds each decoder layer from its global layer number. Each MTP depth ``k`` is
seeded the same way from global position ``num_layers + k`` when ``seed`` is given, so MTP weights (and the
output layer drawn after them) do not depend on the pipeline layout.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

MTP_MODULE = "megatron.core.transformer.multi_token_prediction"


def mtp_block_spec(config, decoder_block_spec, *, te: bool, vp_stage: Optional[int] = None,
                   pp_rank: Optional[int] = None, seed: Optional[int] = None):
    """What ``build_model`` passes as ``GPTModel(mtp_block_spec=...)`` for this chunk.

    None when ``config.mtp_num_layers`` is falsy or when this (pipeline stage, virtual chunk) does not hold
    the MTP layers (they live in the last chunk of the last stage). ``decoder_block_spec`` is the chunk's
    decoder block spec as given to ``GPTModel`` (TE or local, seeded or not). Call after
    ``initialize_model_parallel``. With ``seed``, MTP depth k is initialised from global position
    ``num_layers + k``, independent of the layout.
    """
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt import gpt_layer_specs

    # Looked up on the module (not imported by name) so tests can stand in for it.
    spec = gpt_layer_specs.get_gpt_mtp_block_spec(config, decoder_block_spec, use_transformer_engine=te,
                                                  vp_stage=vp_stage, pp_rank=pp_rank)
    if spec is None:
        return None
    if not te:
        from models import backend

        spec = backend._replace_norms(spec)  # enorm / hnorm / final_layernorm: SP-capable torch norm
    if seed is not None:
        spec = _seed_mtp_layers(spec, config, seed)
    return spec


def mtp_supported_on_local_spec() -> Tuple[bool, str]:
    """Whether Megatron-Core's local (non-TE) spec can train MTP in this process, and why not if it cannot.

    The local spec builds and trains MTP (checked on CPU with gloo: forward with labels, backward, non-zero
    gradients on every MTP parameter) once its norms are swapped (done by :func:`mtp_block_spec`). On CPU the
    remaining need is the CUDA bridge for ``multi_token_prediction``, whose training-mode forward creates
    its loss-logging buffers with ``device=torch.cuda.current_device()``.
    """
    if torch.cuda.is_available():
        return True, "local spec builds MTP; CUDA present"
    from models import cpu_compat

    if MTP_MODULE not in cpu_compat.PATCHED_MODULES:
        return False, (f"on CPU the MTP training forward calls torch.cuda.current_device() in {MTP_MODULE} "
                       f"(MTPLossLoggingHelper.save_metrics_to_tracker); add {MTP_MODULE!r} to "
                       "models.cpu_compat.PATCHED_MODULES")
    return True, "local spec builds and trains MTP on CPU (norms swapped for SequenceParallelNorm)"


def _seed_mtp_layers(spec, config, seed: int):
    """MTP layers that reseed the CPU generator from their global position before building; their inner
    transformer layer uses Megatron's own class (the builder's seeded layer would reseed from the *decoder*
    offset of this stage, which depends on the layout and collides with decoder layer 1's seed)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    mtp_layer_cls = _seeded_mtp_layer_class(seed, config.num_layers)
    layer_specs = []
    for layer_spec in spec.layer_specs:
        inner = layer_spec.submodules.mtp_model_layer
        if (isinstance(inner, ModuleSpec) and isinstance(inner.module, type)
                and issubclass(inner.module, TransformerLayer) and inner.module.__module__.startswith("models.")):
            inner = dataclasses.replace(inner, module=TransformerLayer)
        submodules = dataclasses.replace(layer_spec.submodules, mtp_model_layer=inner)
        layer_specs.append(dataclasses.replace(layer_spec, module=mtp_layer_cls, submodules=submodules))
    return dataclasses.replace(spec, layer_specs=layer_specs)


def _seeded_mtp_layer_class(seed: int, num_layers: int):
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from models.seeds import layer_seed  # the decoder's rule: MTP depth k follows layer L

    class SeededMultiTokenPredictionLayer(MultiTokenPredictionLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            # layer_number is the MTP depth (1-based); global position after the decoder's num_layers
            torch.manual_seed(layer_seed(seed, num_layers + layer_number))
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    return SeededMultiTokenPredictionLayer
