"""Which custom kernel, if any, serves a call: by backend, shape and dtype."""

from __future__ import annotations


def kda_mix_kernel(p, x_q, conv_state, state):
    """The kernel implementation of ``kimi_k3.kda.kda_mix`` for these inputs, or None."""
    return None


def expert_glu_kernel(z, w, inds):
    """The kernel implementation of ``kimi_k3.experts.expert_glu`` for these inputs, or None."""
    return None
