"""Checkpoint tools (installed as ``kimi_k3.convert``): synthetic checkpoints and conversion."""
