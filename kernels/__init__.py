"""Custom Metal and CUDA kernels for Kimi K3 (installed as ``kimi_k3.kernels``)."""
