"""MXFP4 expert prefill on tensor cores: the grouped GEMM of ``mxfp4_prefill`` as fp16 MMAs.

Same contract as ``mxfp4_prefill.expert_glu_prefill`` (pairs sorted by expert, tiles of TM
pairs of one expert, launch 1 gate/up + SiTU-GLU into ``h`` [P, I] in sorted order, launch 2
down times the routing weight), with the products on ``SIMD_MMA`` (m16n8k16, fp16 inputs,
fp32 accumulators) as in ``mxfp4_mma``:

* **Activations once per row, as B fragments.** ``mxfp4_bfrag`` turns each row of the
  activations (a token's latent, or a pair's ``h``) into fp16 hi and lo (times a power of two
  per row: largest |x| in [2^14, 2^15); 22 significant bits) laid out as the MMA's B
  fragments, so the GEMM stages a chunk of them with one 8-byte load per lane and slot.
* **One MMA's k within one scale group.** MMA m (0, 1) of group j takes words 2m and 2m + 1
  of the group: lane (g, tq) holds codes (j0, j0 + 4) and (j0 + 1, j0 + 5) of word
  2m + tq / 2 (j0 = 2 (tq % 2)) of rows g and g + 8 (``kk_e2m1_pair``: the code times 2^-14,
  exact); B's rows follow the same k order. The group's two MMAs go into a fresh
  accumulator, which is scaled by the row's E8M0 scale and added to the tile's sum.
* **Four tokens per MMA.** B's column pair (2c, 2c + 1) is token c's hi and lo, so lane
  (g, tq) ends up with token tq's two parts for rows g and g + 8: their sum, times the row's
  unscaling, is the product. A warp owns 16 rows of w1 and w3 (or 32 of w2) and all TM
  tokens of the tile (TM / 4 column tiles), so each decoded fragment feeds TM / 4 MMAs.

The threadgroup (RT warps, RT row units) stages KC groups of the tile's B fragments at a
time in threadgroup memory. The Metal rendering of ``SIMD_MMA`` is shuffles (correct,
slow): the emulator checks the fragment bookkeeping, and these kernels are meant for CUDA.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import expert_layout
from .mxfp4_decode import K3
from .mxfp4_mma import MMA_HEADER
from .mxfp4_prefill import grouped_glu, tile_tokens_for
from .source import Instance, Kernel, derived, swap
from .source import backend as default_backend

# Per row of x [R, KD]: its B fragments frag [R, G, 2 (m), 2 (hi, lo), 4 (tq)] (uint2 each)
# and the factor that undoes its scaling (and the codes' 2^-14).
BFRAG_BODY = """
  constexpr int G = KD / 32;
  SHARED float s_max[32];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const size_t r = GROUP_POS.x;                       // rows on x: y stops at 65535
  const DEVICE T* xr = x + r * KD;
  float m = 0.0f;
  for (uint i = tid; i < KD; i += GROUP_SIZE.x) m = FMAX(m, FABS(static_cast<float>(xr[i])));
  m = SIMD_MAX(m);
  if (lane == 0) s_max[warp] = m;
  BARRIER();
  m = s_max[0];
  for (uint w = 1; w < GROUP_SIZE.x / 32; ++w) m = FMAX(m, s_max[w]);
  int n = 141 - int((AS_UINT(m) >> 23) & 255u);
  n = n > 127 ? 127 : (n < -113 ? -113 : n);
  const float up = AS_FLOAT(uint(n + 127) << 23);
  if (tid == 0) unscale[r] = AS_FLOAT(uint(141 - n) << 23);
  // Slot it = ((grp * 2 + mm) * 2 + hl) * 4 + lt: codes (j0, j0 + 4), (j0 + 1, j0 + 5) of
  // word 2 mm + lt / 2 of group grp, j0 = 2 (lt % 2); hi (hl = 0) or lo.
  for (uint it = tid; it < G * 16; it += GROUP_SIZE.x) {
    const uint lt = it % 4, hl = (it / 4) % 2, mm = (it / 8) % 2, grp = it / 16;
    const DEVICE T* src = xr + 32 * grp + 8 * (2 * mm + lt / 2) + 2 * (lt % 2);
    float v[4];
    v[0] = static_cast<float>(src[0]) * up;
    v[1] = static_cast<float>(src[4]) * up;
    v[2] = static_cast<float>(src[1]) * up;
    v[3] = static_cast<float>(src[5]) * up;
    if (hl) {
      for (int e = 0; e < 4; ++e) v[e] -= ROUND_HALF(v[e]);
    }
    ((DEVICE uint2*)frag)[r * (G * 16) + it] =
        UINT2(PACK_HALF2(v[0], v[1]), PACK_HALF2(v[2], v[3]));
  }
"""

BODY = """
  constexpr int G = KD / 32;
  constexpr int NT = TM / 4;                          // column tiles (4 tokens, hi and lo)
  constexpr int UNITS = NMAT == 2 ? NOUT / 16 : NOUT / 32;
  constexpr int SLOTS = KC * 2 * NT * 32;             // B fragments of a chunk of KC groups
  SHARED uint2 bs[SLOTS];                             // [group][m][column tile][lane]
  SHARED float s_un[TM];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const int start = tiles[3 * GROUP_POS.x];
  const int len = tiles[3 * GROUP_POS.x + 1];
  const size_t expert = (size_t)tiles[3 * GROUP_POS.x + 2];
  if (len == 0) return;                               // the whole threadgroup leaves together
  const uint unit = GROUP_POS.y * RT + warp;
  const bool active = unit < UNITS;                   // the whole warp agrees
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const size_t ra = expert * NOUT + (NMAT == 2 ? 16 : 32) * (active ? unit : 0) + g;
  const size_t rb = NMAT == 2 ? ra : ra + 16;
  const DEVICE uint4* qa = (const DEVICE uint4*)wa + ra * G;
  const DEVICE uint4* qb = (const DEVICE uint4*)wb + rb * G;
  const DEVICE uint8_t* ea = sa + ra * G;
  const DEVICE uint8_t* eb = sb + rb * G;
  const DEVICE uint2* fr = (const DEVICE uint2*)frag;
  for (uint t = tid; t < TM; t += 32 * RT) {
    s_un[t] = (int)t < len ? unscale[NMAT == 2 ? (size_t)xrow[start + t] : (size_t)(start + t)]
                           : 0.0f;
  }
  // Lane (lg, lt) of column tile nt reads token 4 nt + lg / 2's hi (lg even) or lo slots lt.
  float4 acc_a[NT], acc_b[NT];
  _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {
    acc_a[nt] = FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);
    acc_b[nt] = acc_a[nt];
  }
  const uint wsel = tq / 2;                           // word 2 m + wsel of the group
  const int j0 = 2 * int(tq % 2);
  for (int g0 = 0; g0 < G; g0 += KC) {
    if (g0 > 0) BARRIER();                            // the previous chunk's readers are done
    for (uint it = tid; it < SLOTS; it += 32 * RT) {
      const uint l = it % 32, nt = (it / 32) % NT, mm = (it / (32 * NT)) % 2;
      const uint grp = g0 + it / (64 * NT);
      const int tok = 4 * int(nt) + int(l / 8);
      uint2 v = UINT2(0u, 0u);
      if (tok < len && grp < G) {
        const size_t row = NMAT == 2 ? (size_t)xrow[start + tok] : (size_t)(start + tok);
        v = fr[(row * G + grp) * 16 + (mm * 2 + (l / 4) % 2) * 4 + l % 4];
      }
      bs[it] = v;
    }
    BARRIER();
    if (active) {
      for (int gi = 0; gi < KC && g0 + gi < G; ++gi) {
        const uint grp = g0 + gi;
        const uint4 wa0 = qa[grp], wa8 = qa[8 * G + grp], wb0 = qb[grp], wb8 = qb[8 * G + grp];
        const float sa0 = kk_e8m0_bits(ea[grp]), sa8 = kk_e8m0_bits(ea[8 * G + grp]);
        const float sb0 = kk_e8m0_bits(eb[grp]), sb8 = kk_e8m0_bits(eb[8 * G + grp]);
        uint4 fa[2], fb[2];
        _Pragma("unroll") for (int mm = 0; mm < 2; ++mm) {
          const uint xa0 = kk_word(wa0, 2 * mm + wsel), xa8 = kk_word(wa8, 2 * mm + wsel);
          const uint xb0 = kk_word(wb0, 2 * mm + wsel), xb8 = kk_word(wb8, 2 * mm + wsel);
          fa[mm] = UINT4(kk_e2m1_pair(xa0, j0), kk_e2m1_pair(xa8, j0),
                         kk_e2m1_pair(xa0, j0 + 1), kk_e2m1_pair(xa8, j0 + 1));
          fb[mm] = UINT4(kk_e2m1_pair(xb0, j0), kk_e2m1_pair(xb8, j0),
                         kk_e2m1_pair(xb0, j0 + 1), kk_e2m1_pair(xb8, j0 + 1));
        }
        _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {
          const uint2 b0 = bs[((gi * 2) * NT + nt) * 32 + lane];
          const uint2 b1 = bs[((gi * 2 + 1) * NT + nt) * 32 + lane];
          const float4 z = FLOAT4(0.0f, 0.0f, 0.0f, 0.0f);
          const float4 ca = SIMD_MMA(SIMD_MMA(z, fa[0], b0, lane), fa[1], b1, lane);
          const float4 cb = SIMD_MMA(SIMD_MMA(z, fb[0], b0, lane), fb[1], b1, lane);
          acc_a[nt].x += sa0 * ca.x;
          acc_a[nt].y += sa0 * ca.y;
          acc_a[nt].z += sa8 * ca.z;
          acc_a[nt].w += sa8 * ca.w;
          acc_b[nt].x += sb0 * cb.x;
          acc_b[nt].y += sb0 * cb.y;
          acc_b[nt].z += sb8 * cb.z;
          acc_b[nt].w += sb8 * cb.w;
        }
      }
    }
  }
  if (!active) return;
  // Lane (g, tq) holds token 4 nt + tq's hi and lo parts for rows g and g + 8 of both tiles.
  const uint r0 = (NMAT == 2 ? 16 : 32) * unit + g;
  _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {
    const int tok = 4 * nt + int(tq);
    if (tok < len) {
      const float un = s_un[tok];
      const float a0 = (acc_a[nt].x + acc_a[nt].y) * un, a8 = (acc_a[nt].z + acc_a[nt].w) * un;
      const float b0 = (acc_b[nt].x + acc_b[nt].y) * un, b8 = (acc_b[nt].z + acc_b[nt].w) * un;
      DEVICE float* dst = out + (size_t)(start + tok) * NOUT + r0;
      if (NMAT == 2) {
        dst[0] = kk_situ_glu(a0, b0, act[0], act[1]);
        dst[8] = kk_situ_glu(a8, b8, act[0], act[1]);
      } else {
        const float pw = pair_w[start + tok];
        dst[0] = a0 * pw;
        dst[8] = a8 * pw;
        dst[16] = b0 * pw;
        dst[24] = b8 * pw;
      }
    }
  }
"""

U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32
BFRAG_THREADS = 256
# Warps (row units) per threadgroup, scale groups per staged chunk, by TM (pairs per tile).
# The chunk takes KC * TM * 128 bytes of threadgroup memory (16 KB for both).
LAUNCH = {16: (4, 8), 32: (4, 4)}
INPUTS = ["frag", "unscale", "xrow", "tiles", "wa", "sa", "wb", "sb", "pair_w", "act"]


def template(KD: int, NOUT: int, NMAT: int, TM: int, rt: int | None = None, kc: int | None = None):
    d_rt, d_kc = LAUNCH[TM]
    return [
        ("KD", KD),
        ("NOUT", NOUT),
        ("NMAT", NMAT),
        ("TM", TM),
        ("RT", rt or d_rt),
        ("KC", kc or d_kc),
    ]


MXFP4_BFRAG = Kernel(
    "mxfp4_bfrag",
    ["x"],
    ["frag", "unscale"],
    BFRAG_BODY,
    header=MMA_HEADER,
    instances=[
        Instance([dt], [U32, F32], [("T", dt), ("KD", K3["D"])])
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]
    + [Instance([F32], [U32, F32], [("T", F32), ("KD", K3["I"])])],
)

MXFP4_GROUPED_MMA = Kernel(
    "mxfp4_grouped_mma",
    INPUTS,
    ["out"],
    BODY,
    header=MMA_HEADER,
    instances=[
        Instance(
            [U32, F32, I32, I32, U32, U8, U32, U8, F32, F32],
            [F32],
            template(kd, nout, nmat, tm),
        )
        for tm in LAUNCH
        for kd, nout, nmat in ((K3["D"], K3["I"], 2), (K3["I"], K3["D"], 1))
    ],
)


# ``expert_layout``'s tiles: row r's scale group j's 16-byte word of codes at
# (r / 16 * (G / 4) + j / 4) * 64 + (r % 16) * 4 + j % 4 (row g + 8 is 32 further). Its scale
# bytes: lane (g, tq)'s rows g and g + 8 of a pair of blocks (8 groups) are the 16 bytes at
# 128 (j / 8) + 16 g of the tile's scales (byte 4 (j % 4) + 2 ((j / 4) % 2) + h, h = 1 for
# row g + 8; ``expert_layout``'s index), the 8 bytes at 128 (j / 8) + 8 g of a lone last
# block (byte 2 (j % 4) + h). ``scales="words"``: each lane loads them once per 8 groups and
# takes its bytes from registers; ``"halves"``: rows g and g + 8 of a group as one 16-bit
# load.
_TILED = (
    (
        "(const DEVICE uint4*)wa + ra * G;",
        "(const DEVICE uint4*)wa + (ra / 16 * (G / 4) * 64 + ra % 16 * 4);",
    ),
    (
        "(const DEVICE uint4*)wb + rb * G;",
        "(const DEVICE uint4*)wb + (rb / 16 * (G / 4) * 64 + rb % 16 * 4);",
    ),
    ("sa + ra * G;", "sa + ra / 16 * (G / 4) * 64;"),
    ("sb + rb * G;", "sb + rb / 16 * (G / 4) * 64;"),
)
_LOADS = (
    "        const uint4 wa0 = qa[grp], wa8 = qa[8 * G + grp], "
    "wb0 = qb[grp], wb8 = qb[8 * G + grp];\n"
    "        const float sa0 = kk_e8m0_bits(ea[grp]), sa8 = kk_e8m0_bits(ea[8 * G + grp]);\n"
    "        const float sb0 = kk_e8m0_bits(eb[grp]), sb8 = kk_e8m0_bits(eb[8 * G + grp]);\n"
)
# A group's code words in tiles (tg), and its scale bytes' offset (ts: row g; row g + 8 at
# ts + 1), the lines both ways of loading the scales share
_TG = "        const uint tg = grp / 4 * 64 + grp % 4;\n"
_TS = (
    "        const uint tl = 4 * g + grp % 4;\n"
    "        const uint ts = 128 * (grp / 8) + (((G / 4) % 2 && grp / 4 == G / 4 - 1)\n"
    "                                               ? 2 * tl\n"
    "                                               : 4 * tl + 2 * ((grp / 4) % 2));\n"
)
_CODES = "        const uint4 wa0 = qa[tg], wa8 = qa[32 + tg], wb0 = qb[tg], wb8 = qb[32 + tg];\n"
_TILED_HALVES = (
    _LOADS,
    _TG + _TS + _CODES + "        const uint xs = *(const DEVICE uint16_t*)(ea + ts);\n"
    "        const uint ys = *(const DEVICE uint16_t*)(eb + ts);\n"
    "        const float sa0 = kk_e8m0_bits(xs & 255u), sa8 = kk_e8m0_bits(xs >> 8);\n"
    "        const float sb0 = kk_e8m0_bits(ys & 255u), sb8 = kk_e8m0_bits(ys >> 8);\n",
)
_TILED_WORDS = (
    (
        "  const uint wsel = tq / 2;",
        "  const uint wsel = tq / 2;\n"
        "  uint4 swa = UINT4(0u, 0u, 0u, 0u), swb = swa;        // scale bytes of 8 groups",
    ),
    (
        _LOADS,
        _TG + "        const bool lone = (G / 4) % 2 && grp / 4 == G / 4 - 1;\n"
        "        if (grp % 8 == 0) {                         // the groups run in order\n"
        "          const uint so = 128 * (grp / 8) + (lone ? 8 : 16) * g;\n"
        "          if (lone) {\n"
        "            const uint2 xa = *(const DEVICE uint2*)(ea + so);\n"
        "            const uint2 xb = *(const DEVICE uint2*)(eb + so);\n"
        "            swa = UINT4(xa.x, xa.y, 0u, 0u);\n"
        "            swb = UINT4(xb.x, xb.y, 0u, 0u);\n"
        "          } else {\n"
        "            swa = *(const DEVICE uint4*)(ea + so);\n"
        "            swb = *(const DEVICE uint4*)(eb + so);\n"
        "          }\n"
        "        }\n"
        "        const uint sk = lone ? 2 * (grp % 4) : 4 * (grp % 4) + 2 * ((grp / 4) % 2);\n"
        "        const uint sh = 8 * (sk % 4);\n"
        "        const uint xs = kk_word(swa, sk / 4), ys = kk_word(swb, sk / 4);\n"
        + _CODES
        + "        const float sa0 = kk_e8m0_bits((xs >> sh) & 255u);\n"
        "        const float sa8 = kk_e8m0_bits((xs >> (sh + 8)) & 255u);\n"
        "        const float sb0 = kk_e8m0_bits((ys >> sh) & 255u);\n"
        "        const float sb8 = kk_e8m0_bits((ys >> (sh + 8)) & 255u);\n",
    ),
)
SCALES = {"halves": (_TILED_HALVES,), "words": _TILED_WORDS}
# The scale loads a tiled stack's prefill takes, by pairs a tile (or one for all as a str):
# halves win at 16 pairs, words at 32, although words need 129 registers there (ptxas)
# (docs/benchmarks.md#prefill-one-layer-of-896-experts).
TILED_SCALES: dict | str = {16: "halves", 32: "words"}


def scales_for(tm: int) -> str:
    """``TILED_SCALES``' choice for tiles of ``tm`` pairs."""
    return TILED_SCALES if isinstance(TILED_SCALES, str) else TILED_SCALES[tm]


def tiled_layout(kernel: Kernel, scales: str = "words") -> Kernel:
    """``kernel`` (``MXFP4_GROUPED_MMA``) reading expert stacks in ``expert_layout``'s tiles,
    named ``<name>_tiled`` (``scales``: ``SCALES``' way of loading the scale bytes; other than
    ``"words"``, named ``<name>_tiled_<scales>``): only the loads move, so the same bits."""
    made = _TILED_MAKERS.get(scales)
    if made is None:
        raise ValueError(
            f"mxfp4_prefill_mma.tiled_layout: scales={scales!r} (takes {list(SCALES)})"
        )
    return derived(kernel, *made)


def _tiled(kernel: Kernel, scales: str) -> Kernel:
    body = swap(kernel.body, _TILED + SCALES[scales], "mxfp4_prefill_mma.tiled_layout")
    suffix = "_tiled" if scales == "words" else f"_tiled_{scales}"
    return kernel.variant(suffix, body=body)


# ``derived``'s tag and maker per way, made once (the dispatch path looks one up per call)
_TILED_MAKERS = {s: (f"tiled_{s}", functools.partial(_tiled, scales=s)) for s in SCALES}


def b_fragments(x: mx.array, backend: str):
    """``mxfp4_bfrag``: x [R, KD] -> (frag [R, KD] uint32: hi and lo fp16 per element in B's
    layout, unscale [R] fp32)."""
    R, KD = x.shape
    frag, unscale = MXFP4_BFRAG(
        backend,
        inputs=[x],
        output_shapes=[(R, KD), (R,)],
        output_dtypes=[U32, F32],
        grid=(BFRAG_THREADS * R, 1, 1),
        threadgroup=(BFRAG_THREADS, 1, 1),
        template=[("T", x.dtype), ("KD", KD)],
    )
    return frag, unscale


def expert_glu_prefill_mma(
    z,
    w,
    inds,
    weights,
    beta,
    cap,
    tile_tokens: int | None = None,
    backend: str | None = None,
    launch: tuple | None = None,
    tiled: bool | None = None,
):
    """``mxfp4_prefill.expert_glu_prefill`` on tensor cores (same shapes and return: fp32
    [N, D]); ``launch`` = (warps per threadgroup, groups per chunk) overrides ``LAUNCH``.
    ``tiled`` (default: whether ``w`` is ``expert_layout.TiledStacks``): ``w`` in the tiled
    layout."""
    backend = backend or default_backend()
    tiled = expert_layout.is_tiled(w) if tiled is None else tiled
    # The LUT kernel's rule (16 pairs while an expert's expected run fits, else 32) measured
    # right for this kernel too on the H200 (docs/benchmarks.md#mxfp4-prefill-parameters).
    tm = tile_tokens or tile_tokens_for(inds.size, w["w1"][0].shape[0])
    if tm not in LAUNCH:
        raise ValueError(f"mxfp4_grouped_mma: tile_tokens={tm} (takes {sorted(LAUNCH)})")
    rt, kc = launch or LAUNCH[tm]
    kernel = tiled_layout(MXFP4_GROUPED_MMA, scales_for(tm)) if tiled else MXFP4_GROUPED_MMA

    def gemm(x, a, b, kd, nout, nmat, xrow, tiles, pair_w, act):
        frag, unscale = b_fragments(x, backend)
        units = nout // 16 if nmat == 2 else nout // 32
        (out,) = kernel(
            backend,
            inputs=[frag, unscale, xrow, tiles, *a, *b, pair_w, act],
            output_shapes=[(inds.size, nout)],
            output_dtypes=[F32],
            grid=(32 * rt * tiles.shape[0], -(-units // rt), 1),
            threadgroup=(32 * rt, 1, 1),
            template=template(kd, nout, nmat, tm, rt, kc),
        )
        return out

    return grouped_glu(z, w, inds, weights, beta, cap, tm, gemm)
