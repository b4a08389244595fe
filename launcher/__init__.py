"""Megatron-Core pretraining launcher: compose, validate, plan, render, submit.

Login-node code: importing this package (and compose/validate/plan/render) must not import torch or megatron.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The launcher checkout (repository root)."""
RECIPES_DIR = ROOT / "recipes"
