"""Checkpoints on the ranks: save and resume through ``dist_checkpointing`` (``store``), asynchronous saves
(``async_save``), Megatron-FSDP's format (``fsdp``), FSDP <-> DP conversion (``convert``) and the optimizer state's
layout (``optimizer_state``)."""
