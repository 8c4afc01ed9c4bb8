"""The Metal emulator: MLX's generated signature, threadgroup semantics, and the bugs it catches."""

import mlx.core as mx
import numpy as np
import pytest

from kimi_k3.kernels.metal_emulator import kernel_name, metal_kernel

REDUCE = """
  threadgroup float part[64];
  uint t = thread_position_in_threadgroup.x;
  part[t] = x[thread_position_in_grid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (uint i = 0; i < 64; ++i) s += part[(t + i) % 64];
  out[thread_position_in_grid.x] = s;
"""


@pytest.fixture(autouse=True)
def seed():
    mx.random.seed(0)


def run(source, inputs, n_out, grid, tg, strict=False, **kw):
    names = [f"x{i}" if i else "x" for i in range(len(inputs))]
    k = metal_kernel("t", names, ["out"], source, strict=strict)
    return k(
        inputs=inputs,
        output_shapes=[(n_out,)],
        output_dtypes=[mx.float32],
        grid=grid,
        threadgroup=tg,
        **kw,
    )[0]


def test_signature_follows_mlx():
    source = (
        "out[0] = a[a_ndim - 1] + a_shape[0] + c[0] + s + N + thread_index_in_simdgroup"
        " + thread_position_in_grid.x;"
    )
    k = metal_kernel("sig", ["a", "c", "s"], ["out"], source, header="// head\n")
    inputs = [mx.zeros((2, 8)), mx.zeros((3,), mx.int32), mx.array(2.0, mx.bfloat16)]
    tpl = [("N", 3), ("T", mx.float16), ("B", True)]
    name = "custom_kernel_sig__3_float16_t_1_float_int32_tc_bfloat16_ts_float"
    assert kernel_name("sig", inputs, [mx.float32], tpl) == name
    expected = (
        "// head\n"
        "template <int N, typename T, bool B>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float* a [[buffer(0)]],\n"
        "  const constant int* a_shape [[buffer(1)]],\n"
        "  const constant int& a_ndim [[buffer(2)]],\n"
        "  const constant int32_t* c [[buffer(3)]],\n"
        "  const constant bfloat16_t& s [[buffer(4)]],\n"
        "  device float* out [[buffer(5)]],\n"
        "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{source}\n}}\n\n"
        f'template [[host_name("{name}")]] [[kernel]] decltype({name}<3, float16_t, 1>) '
        f"{name}<3, float16_t, 1>;\n"
    )
    assert k.generated_source(inputs, [mx.float32], tpl) == expected
    out = k(
        inputs=inputs,
        output_shapes=[(1,)],
        output_dtypes=[mx.float32],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        template=tpl,
    )[0]
    assert out.item() == 0 + 2 + 0 + 2 + 3 + 0 + 0  # a[1] + shape[0] + c[0] + s + N + lane + x


def test_signature_without_attributes_or_templates():
    k = metal_kernel("plain", ["x"], ["y", "z"], "y[0] = x[0]; z[0] = 1;")
    text = k.generated_source([mx.zeros((10,))], [mx.float32, mx.int32])
    assert "[[kernel]] void custom_kernel_plain_float_float_int32_t(" in text
    assert text.endswith("  device int32_t* z [[buffer(2)]]) {\ny[0] = x[0]; z[0] = 1;\n}\n")
    assert "template" not in text


def test_threadgroup_memory_and_barrier():
    x = mx.random.normal((256,))
    out = run(REDUCE, [x], 256, (256, 1, 1), (64, 1, 1))
    expect = np.repeat(np.array(x).reshape(4, 64).sum(1), 64)
    np.testing.assert_allclose(np.array(out), expect, rtol=1e-5, atol=1e-5)


def test_missing_barrier_gives_a_wrong_result_every_time():
    x = mx.random.normal((256,))
    broken = REDUCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    a, b = (np.array(run(broken, [x], 256, (256, 1, 1), (64, 1, 1))) for _ in range(2))
    expect = np.repeat(np.array(x).reshape(4, 64).sum(1), 64)
    assert not np.allclose(a, expect, rtol=1e-3, equal_nan=False)
    np.testing.assert_array_equal(a, b)  # deterministic schedule


def test_off_by_one_read_sees_nan():
    x = mx.arange(64).astype(mx.float32)
    out = run(
        "out[thread_position_in_grid.x] = x[thread_position_in_grid.x + 1];",
        [x],
        64,
        (64, 1, 1),
        (32, 1, 1),
    )
    assert np.isnan(np.array(out)[-1])


def test_write_past_the_end_is_reported():
    with pytest.raises(RuntimeError, match="outside a buffer"):
        run(
            "out[thread_position_in_grid.x + 1] = 1.0f;",
            [mx.zeros((4,))],
            64,
            (64, 1, 1),
            (32, 1, 1),
        )


def test_unwritten_outputs_are_nan_unless_init_value():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    out = np.array(run(src, [mx.zeros((4,))], 8, (8, 1, 1), (8, 1, 1)))
    assert np.isnan(out[1::2]).all() and (out[::2] == 1).all()
    out = np.array(run(src, [mx.zeros((4,))], 8, (8, 1, 1), (8, 1, 1), init_value=3.0))
    assert (out[1::2] == 3).all()


def test_simdgroup_functions():
    src = """
      uint l = thread_index_in_simdgroup;
      float v = x[thread_position_in_grid.x];
      uint o = thread_position_in_grid.x * 6;
      out[o + 0] = simd_sum(v);
      out[o + 1] = simd_max(v);
      out[o + 2] = simd_shuffle_xor(v, 5);
      out[o + 3] = simd_broadcast(v, 7);
      out[o + 4] = simd_shuffle_down(v, 1);
      out[o + 5] = simd_prefix_exclusive_sum(v) + l * 0;
    """
    x = mx.random.normal((64,))
    out = np.array(run(src, [x], 64 * 6, (64, 1, 1), (64, 1, 1))).reshape(2, 32, 6)
    xs = np.array(x).reshape(2, 32)
    lanes = np.arange(32)
    np.testing.assert_allclose(out[..., 0], xs.sum(1, keepdims=True).repeat(32, 1), atol=1e-5)
    np.testing.assert_array_equal(out[..., 1], xs.max(1, keepdims=True).repeat(32, 1))
    np.testing.assert_array_equal(out[..., 2], xs[:, lanes ^ 5])
    np.testing.assert_array_equal(out[..., 3], xs[:, [7]].repeat(32, 1))
    np.testing.assert_array_equal(out[..., 4][:, :31], xs[:, 1:])
    np.testing.assert_allclose(out[..., 5], np.cumsum(xs, 1) - xs, rtol=1e-5, atol=1e-6)


def test_partial_threadgroups_and_attributes():
    src = """
      uint i = thread_position_in_grid.x;
      out[i] = threads_per_threadgroup.x * 1000 + threadgroup_position_in_grid.x * 100
               + simdgroup_index_in_threadgroup * 10 + (thread_index_in_threadgroup % 10);
    """
    out = np.array(run(src, [mx.zeros((1,))], 100, (100, 1, 1), (64, 1, 1)))
    assert out[0] == 64000 and out[63] == 64000 + 10 + 3
    assert out[64] == 36000 + 100 and out[99] == 36000 + 100 + 10 + 5


def test_bfloat16_and_templates():
    src = (
        "uint i = thread_position_in_grid.x; out[i] = static_cast<T>(static_cast<float>(x[i]) * N);"
    )
    k = metal_kernel("bf", ["x"], ["out"], src)
    x = mx.random.normal((40,)).astype(mx.bfloat16)
    out = k(
        inputs=[x],
        output_shapes=[(40,)],
        output_dtypes=[mx.bfloat16],
        grid=(40, 1, 1),
        threadgroup=(32, 1, 1),
        template=[("T", mx.bfloat16), ("N", 3)],
    )[0]
    assert out.dtype == mx.bfloat16
    assert mx.array_equal(out, (x.astype(mx.float32) * 3).astype(mx.bfloat16))


def test_atomic_outputs():
    src = "atomic_fetch_add_explicit(&out[0], x[thread_position_in_grid.x], memory_order_relaxed);"
    k = metal_kernel("atom", ["x"], ["out"], src, atomic_outputs=True)
    x = mx.arange(100).astype(mx.float32)
    out = k(
        inputs=[x],
        output_shapes=[(1,)],
        output_dtypes=[mx.float32],
        grid=(100, 1, 1),
        threadgroup=(32, 1, 1),
        init_value=0.0,
    )[0]
    assert out.item() == 4950


@pytest.mark.parametrize(
    "source, strict, error",
    [
        (
            "if (thread_position_in_threadgroup.x < 8) simd_sum(1.0f);"
            "else threadgroup_barrier(mem_flags::mem_threadgroup); out[0] = 1;",
            False,
            "deadlock",
        ),
        (
            "if (thread_position_in_threadgroup.x < 8)"
            " threadgroup_barrier(mem_flags::mem_threadgroup); out[0] = 1;",
            True,
            "exited",
        ),
        (
            "if (thread_position_in_threadgroup.x < 8) out[0] = simd_sum(1.0f);",
            True,
            "inactive lanes",
        ),
        (
            "threadgroup float big[9000]; uint t = thread_position_in_threadgroup.x;"
            " big[t * 140] = t; threadgroup_barrier(mem_flags::mem_threadgroup);"
            " out[0] = big[(t + 1) % 64 * 140];",
            False,
            "threadgroup memory",
        ),
    ],
)
def test_divergence_and_limits_are_reported(source, strict, error):
    with pytest.raises(RuntimeError, match=error):
        run(source, [mx.zeros((1,))], 1, (64, 1, 1), (64, 1, 1), strict=strict)


def test_threadgroup_pointers_are_refused():
    src = "threadgroup float buf[4]; threadgroup float* p = buf; out[0] = p[0];"
    with pytest.raises(ValueError, match="threadgroup array"):
        run(src, [mx.zeros((1,))], 1, (32, 1, 1), (32, 1, 1))


def test_strict_mode_demands_cuda_portable_launches():
    src = "out[thread_position_in_grid.x] = simd_sum(1.0f);"
    k = metal_kernel("s", ["x"], ["out"], src, strict=True)
    args = dict(inputs=[mx.zeros((1,))], output_shapes=[(48,)], output_dtypes=[mx.float32])
    with pytest.raises(RuntimeError, match="multiple of the threadgroup"):
        k(**args, grid=(48, 1, 1), threadgroup=(32, 1, 1))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        k(**args, grid=(48, 1, 1), threadgroup=(48, 1, 1))
    relaxed = metal_kernel("s", ["x"], ["out"], src)
    out = relaxed(**args, grid=(48, 1, 1), threadgroup=(48, 1, 1))[0]
    assert np.array(out)[40] == 16  # Metal: the partial simdgroup sums its live lanes


def test_kernel_backend_override_is_validated(monkeypatch):
    """KIMI_K3_KERNEL_BACKEND picks the backend; a misspelt value is an error naming the
    variable at once, not a failure at the first kernel call."""
    from kimi_k3.kernels import source

    for value, want in (("emulator", "emulator"), ("cuda", "cuda"), ("none", None)):
        monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", value)
        assert source.backend() == want
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cdua")
    with pytest.raises(ValueError, match="KIMI_K3_KERNEL_BACKEND='cdua'"):
        source.backend()


def test_build_directory_is_private(tmp_path, monkeypatch):
    """Compiled kernels are loaded from it: a directory others may write to is refused; the
    default is the user's own (mode 0700), not a shared temp path."""
    import os
    import stat

    from kimi_k3.kernels import metal_emulator

    monkeypatch.delenv("KIMI_K3_EMULATOR_CACHE", raising=False)
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    own = metal_emulator.cache_dir()
    st = os.lstat(own)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KIMI_K3_EMULATOR_CACHE", str(shared))
    with pytest.raises(RuntimeError, match=rf"{shared}: compiled kernels are loaded from here"):
        metal_emulator.cache_dir()
