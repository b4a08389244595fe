"""Rank-side helpers for ``launcher.train`` (imports torch and megatron.core; never on the login node)."""
