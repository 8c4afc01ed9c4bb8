"""The expert store's tiled layout (``kimi_k3.kernels.expert_layout``): the permutation and its
inverse, the tiled grouped GEMM on the emulator and CUDA, the dispatcher's choices for tiled stacks,
the reference reading them, and the whole model, resident and streamed, holding tiles."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import on_cuda, rel_err
from mlx.utils import tree_flatten
from test_mxfp4_kernels import K3, TOL, case, lazy_stack
from test_streaming import PROMPT, STEPS, budget_gb, greedy

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.kernels import dispatch, expert_layout, mxfp4_mma, mxfp4_one, mxfp4_prefill_mma
from kimi_k3.model.experts import ResidentExperts, expert_glu_reference, store_layout
from kimi_k3.streaming import attach_streamer, get_stats


def same(a, b) -> bool:
    return mx.array_equal(a, b).item()


def test_tile_untile_and_one_expert_in_place():
    """``untile`` inverts ``tile``; one expert's bytes tiled in place by numpy (the
    streamer's slots) are that expert's slice of the tiled stack; the index formula of
    ``expert_layout``'s docstring holds."""
    (_, w, *_), _ = case(5, 256, 384, 1, 2, "float32")
    t = expert_layout.tile(w)
    assert expert_layout.is_tiled(t) and not expert_layout.is_tiled(w)
    back = expert_layout.untile(t)
    for n, (q, s) in w.items():
        assert same(back[n][0], q) and same(back[n][1], s)
        assert not same(t[n][0], q)  # a permutation, not the identity
        R, G = q.shape[1], s.shape[2]
        for e in (0, 3):
            qb = np.array(q[e]).view(np.uint8).reshape(-1).copy()
            sb = np.array(s[e]).reshape(-1).copy()
            expert_layout.tile_expert_bytes(qb, sb, R)
            assert np.array_equal(qb, np.array(t[n][0][e]).view(np.uint8).reshape(-1))
            assert np.array_equal(sb, np.array(t[n][1][e]).reshape(-1))
        # every code word and scale byte where the docstring's index says (w1, w3: 2 blocks a
        # row, one 32-bit scale word a lane; w2: 3 blocks, the last one's halfwords)
        qt = np.array(t[n][0]).reshape(-1, 4)  # 16-byte words
        qm = np.array(q).reshape(-1, 4)
        st, sm = np.array(t[n][1]).reshape(-1), np.array(s).reshape(-1)
        nb = G // 4
        for e in range(q.shape[0]):
            for r in range(R):
                t16, h, g = r // 16, (r % 16) // 8, r % 8
                for j in range(G):
                    b, tq = j // 4, j % 4
                    at = ((e * R // 16 + t16) * nb + b) * 64 + 32 * h + 4 * g + tq
                    assert np.array_equal(qt[at], qm[(e * R + r) * G + j])
                    lane = 4 * g + tq
                    o = 2 * lane + h if nb % 2 and b == nb - 1 else 4 * lane + 2 * (b % 2) + h
                    at = (e * R // 16 + t16) * 16 * G + 128 * (b // 2) + o
                    assert st[at] == sm[(e * R + r) * G + j]
    assert expert_layout.untile(w) is w
    with pytest.raises(ValueError, match="already tiled"):
        expert_layout.tile(t)


def test_tiling_refuses_shapes_without_whole_tiles():
    (_, w, *_), _ = case(3, 64, 96, 1, 2, "float32")  # 2 scale groups a row of w1
    with pytest.raises(ValueError, match="expert stack w1: weight \\(3, 96, 8\\)"):
        expert_layout.tile(w)
    with pytest.raises(ValueError, match="no 24-row matrix in whole tiles"):
        expert_layout.tile_expert_bytes(np.zeros(24 * 64, np.uint8), np.zeros(24 * 4, np.uint8), 24)


@pytest.mark.parametrize("N", [1, 9])
def test_reference_reads_tiled_stacks(N):
    """The reference untiles (the experts it reads, or the whole stack when the call reads
    more pairs than it holds): the same bits as on MLX's layout."""
    (z, w, inds, wts, beta, cap), want = case(5, 256, 384, N, 2, "float32")
    got = expert_glu_reference(z, expert_layout.tile(w), inds, wts, beta, cap)
    assert same(got, expert_glu_reference(z, w, inds, wts, beta, cap))
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("scales", [None, *mxfp4_prefill_mma.SCALES])  # None: as dispatched
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,tm",
    [
        (5, 128, 256, 9, 2, "float32", 16),
        (7, 256, 128, 17, 4, "bfloat16", 32),
        (3, 384, 128, 5, 2, "float32", 16),  # 3 blocks a row of w1: a pair, then a lone one
        *(on_cuda(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32)),
    ],
)
def test_prefill_mma_on_tiles_gives_the_same_bits(
    monkeypatch, backend, E, D, I, N, k, dtype, tm, scales
):
    """``mxfp4_prefill_mma.tiled_layout`` (what a tiled store's prefill runs on CUDA), each
    way of loading the scale bytes, only moves the weight and scale addresses; reading tiles
    as MLX's layout is wrong."""
    if scales:
        monkeypatch.setattr(mxfp4_prefill_mma, "TILED_SCALES", scales)
    (z, w, *rest), want = case(E, D, I, N, k, dtype)
    run = mxfp4_prefill_mma.expert_glu_prefill_mma
    plain = run(z, w, *rest, tile_tokens=tm, backend=backend)
    wt = expert_layout.tile(w)
    got = run(z, wt, *rest, tile_tokens=tm, backend=backend)
    assert same(got, plain) and rel_err(got, want) < TOL
    wrong = run(z, wt, *rest, tile_tokens=tm, backend=backend, tiled=False)
    assert rel_err(wrong, want) > 0.1


def test_prefill_scale_loads_by_tile_size(monkeypatch):
    """Each tile size the grouped GEMM launches has a way of loading a tiled stack's scales
    (``TILED_SCALES``, a dict by size or one str for all); an unknown way is refused by
    name, and a variant's kernel is named by its way."""
    for tm in mxfp4_prefill_mma.LAUNCH:
        assert mxfp4_prefill_mma.scales_for(tm) in mxfp4_prefill_mma.SCALES
    monkeypatch.setattr(mxfp4_prefill_mma, "TILED_SCALES", "halves")
    assert mxfp4_prefill_mma.scales_for(32) == "halves"
    base = mxfp4_prefill_mma.MXFP4_GROUPED_MMA
    assert mxfp4_prefill_mma.tiled_layout(base).name == f"{base.name}_tiled"
    assert mxfp4_prefill_mma.tiled_layout(base, "halves").name == f"{base.name}_tiled_halves"
    with pytest.raises(ValueError, match="scales='nibbles'"):
        mxfp4_prefill_mma.tiled_layout(base, "nibbles")


def test_dispatcher_for_tiled_stacks(monkeypatch):
    """On CUDA (chosen, not run) tiled stacks get the kernels' tiled variants: one launch up
    to EXPERT_ONE_LAUNCH_MAX_PAIRS pairs, three above, the tiled grouped GEMM for prefill.
    Where no tiled kernel applies (another backend, dims mxfp4_mma does not take) the
    dispatcher gives None: the reference, which untiles."""
    for var in ("KIMI_K3_REFERENCE", "KIMI_K3_EXPERT_DECODE", "KIMI_K3_EXPERT_PREFILL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cuda")
    wt = expert_layout.tile(lazy_stack(8, 128, 256))

    def chosen(pairs, k=2):
        inds = mx.zeros((pairs // k, k), mx.int32)
        return dispatch.expert_glu_kernel(mx.zeros((pairs // k, 128), mx.bfloat16), wt, inds)

    most = dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS
    assert chosen(2).func is chosen(most).func is mxfp4_one.expert_glu_decode_tiled
    assert chosen(most + 2).func is mxfp4_mma.expert_glu_decode_tiled
    fn = chosen(dispatch.EXPERT_DECODE_MAX_PAIRS + 2)
    assert fn.func is mxfp4_prefill_mma.expert_glu_prefill_mma and fn.keywords["tiled"]
    plain = dispatch.expert_glu_kernel(
        mx.zeros((1, 128), mx.bfloat16), lazy_stack(8, 128, 256), mx.zeros((1, 2), mx.int32)
    )
    assert plain.func is mxfp4_one.expert_glu_decode
    assert dispatch.expert_glu_kernel(mx.zeros((1, 128), mx.float64), wt, mx.zeros((1, 2))) is None
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    assert chosen(2) is None and chosen(dispatch.EXPERT_DECODE_MAX_PAIRS + 2) is None


def test_store_layout_choice(monkeypatch):
    monkeypatch.delenv("KIMI_K3_EXPERT_LAYOUT", raising=False)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cuda")
    assert store_layout(None, 3584, 3072) == store_layout("auto", 3584, 3072) == "tiled"
    assert store_layout("auto", 3584, 96) == "mlx"  # no whole tiles
    assert store_layout("mlx", 3584, 3072) == "mlx"
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    assert store_layout("auto", 3584, 3072) == "mlx"  # no tiled kernels there
    assert store_layout("tiled", 128, 128) == "tiled"
    monkeypatch.setenv("KIMI_K3_EXPERT_LAYOUT", "tiled")
    assert store_layout(None, 128, 128) == "tiled"
    monkeypatch.setenv("KIMI_K3_EXPERT_LAYOUT", "tile")
    with pytest.raises(ValueError, match="KIMI_K3_EXPERT_LAYOUT='tile'"):
        store_layout(None, 128, 128)
    with pytest.raises(ValueError, match="latent size 64 and hidden size 128 cannot be tiled"):
        store_layout("tiled", 64, 128)
    with pytest.raises(ValueError, match="expert_layout='tiles'"):
        store_layout("tiles", 128, 128)


def test_resident_store_set_layout():
    """Tiles live under other parameter names (so saving or loading them by the checkpoint's
    names fails loudly) and turn back into the same arrays."""
    store = ResidentExperts(4, 128, 256, 4.0, 25.0)
    (_, w, *_), _ = case(4, 128, 256, 1, 2, "float32")
    for n, (q, s) in w.items():
        getattr(store, n).weight, getattr(store, n).scales = q, s
    store.set_layout("tiled")
    assert store.layout == "tiled" and expert_layout.is_tiled(store.tensors())
    names = sorted(k for k, _ in tree_flatten(store.parameters()))
    assert names[:2] == ["w1.tiled_scales", "w1.tiled_weight"] and len(names) == 6
    with pytest.raises(ValueError):
        store.load_weights([("w1.weight", w["w1"][0])])
    store.set_layout("mlx")
    for n, (q, s) in store.tensors().items():
        assert same(q, w[n][0]) and same(s, w[n][1])
    with pytest.raises(ValueError, match="'mlx' or 'tiled'"):
        store.set_layout("auto")


@pytest.fixture(scope="module")
def small(ckpt_factory):
    return ckpt_factory("small", num_experts=64)


@pytest.fixture(scope="module")
def reference(small):
    return greedy(load_model(small, dtype=mx.float32, expert_layout="mlx"), PROMPT, STEPS)


def test_model_holding_tiles_gives_the_same_logits(small, reference):
    """A model loaded with tiled stores (forced here; on the CPU they run the reference,
    which untiles) gives the MLX layout's fp32 logits bit for bit."""
    model = load_model(small, dtype=mx.float32, expert_layout="tiled")
    names = [k for k, _ in tree_flatten(model.parameters()) if ".experts." in k]
    assert names and all(".tiled_" in k for k in names)
    assert same(greedy(model, PROMPT, STEPS), reference)


@pytest.mark.parametrize("write_mode,direct_io", [("view", True), ("view", False), ("mlx", True)])
def test_streamed_tiles_equal_resident(small, reference, write_mode, direct_io):
    """Slots tiled as they land (in the reader thread through host views, from the aligned
    buffer of a direct read or in place after a buffered one; or by MLX in ``mlx`` mode):
    the resident model's logits bit for bit."""
    model = load_model(
        small,
        dtype=mx.float32,
        expert_cache_gb=budget_gb(small, 16),
        expert_layout="tiled",
        write_mode=write_mode,
        direct_io=direct_io,
    )
    assert same(greedy(model, PROMPT, STEPS), reference)
    stats = get_stats(model)
    assert stats["expert_layout"] == "tiled" and stats["misses"] > 0
    assert stats["direct_io"] is direct_io
    assert stats["reader_read_seconds"] > 0 and stats["reader_place_seconds"] > 0
    assert expert_layout.is_tiled(model.layers[1].block_sparse_moe.experts.pool.w)


def test_attach_streamer_reads_the_layout_variable(small, reference, monkeypatch):
    """``attach_streamer`` called directly follows ``KIMI_K3_EXPERT_LAYOUT`` as ``load_model``
    does (not ``"auto"`` whatever the variable says); an argument still wins."""
    monkeypatch.setenv("KIMI_K3_EXPERT_LAYOUT", "tiled")
    model = load_model(small, dtype=mx.float32, expert_layout="mlx")
    attach_streamer(model, small, None, budget_gb(small, 16))
    assert get_stats(model)["expert_layout"] == "tiled"
    assert same(greedy(model, PROMPT, STEPS), reference)
    model = load_model(small, dtype=mx.float32, expert_layout="mlx")
    attach_streamer(model, small, None, budget_gb(small, 16), expert_layout="mlx")
    assert get_stats(model)["expert_layout"] == "mlx"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mlx", "tiled"])
def test_loading_holds_one_layer_of_expert_copies_at_most(ckpt_factory, layout):
    """``load_model`` drops its tensor dicts and evaluates the experts one MoE layer at a
    time, so its peak memory is the model's plus less than one layer's expert stacks, in
    either layout (before, the dicts kept every per-expert source tensor alive beside its
    stack: about twice the experts at the peak)."""
    path = ckpt_factory("small", num_experts=512)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load_model(path, dtype=mx.float32, expert_layout=layout)
    held = mx.get_active_memory() - base
    extra = mx.get_peak_memory() - base - held
    moe = model.layers[1].block_sparse_moe.experts
    layer = sum(a.nbytes for _, a in tree_flatten(moe.parameters()))
    assert held > 4 * layer  # five MoE layers of experts, and the dense weights
    assert 0 <= extra < layer, (extra, layer)
