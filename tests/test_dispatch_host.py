"""benchmarks/dispatch_host.py: it times the dispatch path it says (CUDA's, launches faked)
and leaves the kernels' launch in place afterwards."""

import pytest

from benchmarks import dispatch_host
from kimi_k3.kernels import source


def test_times_cuda_dispatch_and_restores_launch(monkeypatch):
    real = source.Kernel.__call__
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cuda")
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_EXPERT_LAYOUT", raising=False)
    seen = []
    orig = dispatch_host.fake_launch

    def counting(self, backend, **kw):
        seen.append((self.name, backend))
        return orig(self, backend, **kw)

    monkeypatch.setattr(dispatch_host, "fake_launch", counting)
    rows = dispatch_host.main(
        ["--dim", "256", "--hidden", "256", "--number", "3", "--repeats", "1"]
    )
    assert [name for name, _ in rows] == ["MLX's layout", "tiles"]
    assert all(t > 0 for _, t in rows)
    names = {n for n, _ in seen}
    assert any(n.startswith("mxfp4_one") and "_tiled" in n for n in names)
    assert any(n.startswith("mxfp4_one") and "_tiled" not in n for n in names)
    assert {b for _, b in seen} == {"cuda"}
    assert source.Kernel.__call__ is real


def test_refuses_another_backend(monkeypatch):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    with pytest.raises(SystemExit, match="KIMI_K3_KERNEL_BACKEND=cuda"):
        dispatch_host.main(["--number", "1", "--repeats", "1"])
