"""MXFP4 expert decode on tensor cores: the dot products as fp16 MMAs with fp32 accumulators.

Same contract and launches as ``mxfp4_decode`` (gate/up + SiTU-GLU, down weighted by the
routing weight, the ordered sum over the k choices), with the per-code work cut down. The
LUT kernels spend four issue slots on every 4-bit code (shift, mask, table load, FMA); here
a code costs about two, and the multiply-adds go to the tensor cores:

* **Codes to fp16 in registers.** An E2M1 code ``s e1 e0 m`` placed at fp16 bits 15 and
  11..9 is that code's value times 2^-14 exactly (e = 0 lands on fp16's subnormals, which
  are E2M1's 0 and 0.5). Nibbles j and j + 4 of a 32-bit word sit 16 bits apart, so one
  shift and two masks give a half2 of two codes; the 2^14 goes into the scale. The
  dispatcher's kernels (``DECODE``) make those fp16 high bytes for all eight codes of a word
  at once and take each pair out with one byte permute, which costs fewer instructions.
* **fp32-exact activations as fp16 hi and lo.** The activation row (the latent for
  gate/up, ``h`` for down) is scaled by a power of two (largest |x| in [2^14, 2^15)) and
  split as x = hi + lo, both fp16 (22 significant bits of x; the products themselves are
  exact and summed in fp32).
* **Four scale groups side by side.** A block of four 32-code scale groups is eight
  m16n8k16 MMAs per 16 rows. Lane (g, tq) holds all of group tq of rows g and g + 8 (one
  128-bit load each), and output columns 2 tq, 2 tq + 1 (hi, lo) collect that group alone:
  B's column pair c is the activations of group c and zero elsewhere. So after the eight
  MMAs every lane has its own group's result for its two rows, multiplies it by that
  group's E8M0 scale and adds it up; a row's four lanes are summed once at the end (two
  shuffles). The k order inside a group is permuted to match the half2 pairs; B is laid
  out the same way.

A warp owns 16 rows of two matrices that share the activations (gate and up rows, or two
16-row tiles of down) for a range of scale groups; ``RT`` warps take different row tiles,
``SK`` warps split the groups of a row (summed through threadgroup memory). Every threadgroup
stages the activations' B fragments once, in threadgroup memory (128 bytes per group).

An int8 body (m16n8k32 with the codes turned into int8 by byte permutes and the activations
split into four int8 limbs; commit a61ec75) executed 20% fewer instructions but needed 158
registers and was not faster at any launch shape on the H200 (docs/benchmarks.md), so it
was removed.

``SIMD_MMA`` is PTX's ``mma.sync.m16n8k16`` on CUDA. On Metal it is spelled out with
simdgroup shuffles (exact fp32 arithmetic, kernels/source.py) so that the emulator checks
these kernels' fragment bookkeeping; that rendering is slow, and the dispatcher uses these
kernels on CUDA only (Metal keeps ``mxfp4_decode``'s LUT kernels).
"""

from __future__ import annotations

import mlx.core as mx

from . import mxfp4_decode
from .mxfp4_decode import HEADER, K3, sum_pairs
from .source import Instance, Kernel, constant, derived, swap
from .source import backend as default_backend

MMA_HEADER = (
    HEADER
    + """
// Codes j and j + 4 of a word as a half2 (code j low) worth code * 2^-14 each.
HELPER uint kk_e2m1_pair(uint w, int j) {
  const uint x = w >> (4 * j);
  return ((x & 0x00070007u) << 9) | ((x & 0x00080008u) << 12);
}
// The same by byte permutes: such an fp16 has a zero low byte, and its high byte is the
// code's sign at bit 7 and its other bits at 3..1; made for all eight codes of a word at once
// (even codes in one word, odd in the other, shared by the j's once inlined), then one
// permute per pair. 14.0-14.5 instead of 18.3-18.5 SASS instructions per MMA in the main
// loop (profile_kernels --sass); what the dispatcher uses (DECODE, byte_permute_decode).
HELPER uint kk_e2m1_pair_prmt(uint w, int j) {
  const uint b = (j & 1) ? ((w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu))
                         : (((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu));
  return BYTE_PERM(b, 0u, (j & 2) ? 0x3414u : 0x2404u);
}
// Word i (0-3) of a uint4 (i a compile-time constant in the unrolled loops).
HELPER uint kk_word(uint4 v, int i) { return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w)); }
"""
)


def mma_block(frag: str, scales: tuple, words: str = "", indent: str = "    ") -> str:
    """C lines for one 4-group block (every body here runs it): eight MMAs per tile, then each
    row's result (its group's hi and lo columns) times the group's scale into acc0-acc3.

    Word pq of the lane's group gives the k-pairs (codes j, j + 4) j = 0, 1 of one MMA and
    j = 2, 3 of the next. ``frag``: the lane's B fragment of word pq (an expression in pq);
    ``scales``: the E8M0 bytes of A rows g, g + 8 and B rows g, g + 8; ``words``: a line
    defining the code words wa0, wa8, wb0, wb8 where they are not yet in scope. Every line
    ends in a line continuation, so the block can sit inside a macro."""
    first = "float4 ca0 = FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), ca1 = ca0, cb0 = ca0, cb1 = ca0;"
    lines = [first] + ([words] if words else [])
    lines += [
        '_Pragma("unroll") for (int pq = 0; pq < 4; ++pq) {',
        f"  const uint4 f = bcol ? {frag} : UINT4(0u, 0u, 0u, 0u);",
        "  const uint2 f0 = UINT2(f.x, f.y), f1 = UINT2(f.z, f.w);",
        "  const uint xa0 = kk_word(wa0, pq), xa8 = kk_word(wa8, pq);",
        "  const uint xb0 = kk_word(wb0, pq), xb8 = kk_word(wb8, pq);",
    ]
    for c, t, j in (("ca0", "a", 0), ("cb0", "b", 0), ("ca1", "a", 2), ("cb1", "b", 2)):
        lines += [
            f"  {c} = SIMD_MMA({c}, UINT4(kk_e2m1_pair(x{t}0, {j}), kk_e2m1_pair(x{t}8, {j}),",
            f"{' ' * 26}kk_e2m1_pair(x{t}0, {j + 1}), kk_e2m1_pair(x{t}8, {j + 1})),"
            f" f{j // 2}, lane);",
        ]
    lines.append("}")
    for i, (c, (x, y)) in enumerate((("a", "xy"), ("a", "zw"), ("b", "xy"), ("b", "zw"))):
        lines.append(
            f"acc{i} += kk_e8m0_bits({scales[i]}) * "
            f"((c{c}0.{x} + c{c}0.{y}) + (c{c}1.{x} + c{c}1.{y}));"
        )
    return "".join(f"{indent}{line} \\\n" for line in lines)


# A step of the register kernels (mxfp4_mma, mxfp4_one): NBL 4-group blocks whose code
# words and scale bytes are in the registers q and sc, against the B fragments frag from group
# bb on.
STEP_MACRO = (
    "#define KK_STEP(q, sc, frag, bb, NBL) \\\n"
    '  _Pragma("unroll") for (int u = 0; u < NBL; ++u) { \\\n'
    + mma_block(
        "frag[((bb) / 4 + u) * 32 + pq * 8 + g]",
        ("sc[4 * u]", "sc[4 * u + 1]", "sc[4 * u + 2]", "sc[4 * u + 3]"),
        "const uint4 wa0 = q[4 * u], wa8 = q[4 * u + 1], wb0 = q[4 * u + 2], wb8 = q[4 * u + 3];",
    )
    + "  }\n"
)


def byte_permute_decode(kernel: Kernel) -> Kernel:
    """``kernel`` (any kernel built on ``MMA_HEADER``, bounded or not) with its codes decoded
    by ``kk_e2m1_pair_prmt`` instead of shifts and masks per pair, named ``<name>_prmt``
    (``Kernel.variant``: made once): what ``DECODE`` picks for ``mxfp4_mma``."""
    return derived(kernel, "byte permute", _byte_permute)


def _byte_permute(kernel: Kernel) -> Kernel:
    header = kernel.header.replace("kk_e2m1_pair(uint w", "kk_e2m1_pair_shift(uint w")
    header = header.replace("kk_e2m1_pair_prmt(uint w", "kk_e2m1_pair(uint w")
    return kernel.variant("_prmt", header=header)


# expert_layout's tiles (16-row tiles of 4-group blocks, a block's 16 rows x 64 bytes of
# codes contiguous): lane (g, tq)'s word of a block is word ``lane`` of it, row g + 8's is
# ``lane + 32``, so one warp load is 512 contiguous bytes. The lane's scale bytes of a step
# are one load (KK_SCW): a 32-bit word at 8-group steps (NB = 2: bytes row g, row g + 8 of
# the first block, then of the second), a 16-bit halfword at 4-group steps (KK_SOFF: where
# a block's halfword lies, the last block alone where a row has an odd number of blocks).
# KK_STEP takes byte 2 u + h of the word (h: row g + 8).
_SCALE_WORDS = """\
  static_assert(NB == 1 || NB == 2, "tiled scale words: steps of 4 or 8 groups");
#define KK_SOFF(bb)                                                                 \\
  (128 * ((bb) / 8) + (((G / 4) % 2 && (bb) / 4 == G / 4 - 1)                       \\
                           ? 2 * lane                                               \\
                           : 4 * lane + 2 * (((bb) / 4) % 2)))
#define KK_SCW(e, bb)                                                               \\
  (NB == 2 ? *(const DEVICE uint*)((e) - lane + KK_SOFF(bb))                       \\
           : (uint)(*(const DEVICE uint16_t*)((e) - lane + KK_SOFF(bb))))
#define KK_Q(q, i)"""
_TILED = (
    (
        "  const size_t ra = (size_t)inds[p] * NR + (GLU ? 16 : 32) * (active ? unit : 0) + g;\n"
        "  const size_t rb = GLU ? ra : ra + 16;\n",
        "  const size_t ra = ((size_t)inds[p] * NR + (GLU ? 16 : 32) * (active ? unit : 0)) / 16"
        " * (G / 4) * 64 + lane;\n"
        "  const size_t rb = GLU ? ra : ra + (G / 4) * 64;\n",
    ),
    ("ra * G + tq;", "ra;", 2),
    ("rb * G + tq;", "rb;", 2),
    ("#define KK_Q(q, i)", _SCALE_WORDS),
    ("sc[4 * u] = ea[(bb) + 4 * u];", "if (u == 0) sc[0] = KK_SCW(ea, bb);  "),
    ("sc[4 * u + 1] = ea[8 * G + (bb) + 4 * u];", "if (u == 0) sc[1] = KK_SCW(eb, bb);        "),
    ("sc[4 * u + 2] = eb[(bb) + 4 * u];", "                                 "),
    ("sc[4 * u + 3] = eb[8 * G + (bb) + 4 * u];", "                                         "),
    ("  uint sx[4 * NB], sy[4 * NB];\n", "  uint sx[2], sy[2];\n"),
    ("kk_e8m0_bits(sc[4 * u])", "kk_e8m0_bits((sc[0] >> (16 * u)) & 255u)"),
    ("kk_e8m0_bits(sc[4 * u + 1])", "kk_e8m0_bits((sc[0] >> (16 * u + 8)) & 255u)"),
    ("kk_e8m0_bits(sc[4 * u + 2])", "kk_e8m0_bits((sc[1] >> (16 * u)) & 255u)"),
    ("kk_e8m0_bits(sc[4 * u + 3])", "kk_e8m0_bits((sc[1] >> (16 * u + 8)) & 255u)"),
    ("#undef KK_Q\n", "#undef KK_Q\n#undef KK_SOFF\n#undef KK_SCW\n"),
    ("8 * G + (bb) + 4 * u)", "32 + 16 * (bb) + 64 * u)", 2),
    ("(bb) + 4 * u)", "16 * (bb) + 64 * u)", 2),
)


def tiled_layout(kernel: Kernel) -> Kernel:
    """``kernel`` (``mxfp4_mma``'s register kernel, any decode or bound) reading expert stacks
    in ``expert_layout``'s tiles instead of MLX's, named ``<name>_tiled``: same
    arithmetic in the same order, so the same bits. Dispatched for ``expert_layout.TiledStacks``
    (the expert store's layout where CUDA's kernels serve it)."""
    return derived(kernel, "tiled", _tiled)


def _tiled(kernel: Kernel) -> Kernel:
    return kernel.variant("_tiled", body=swap(kernel.body, _TILED, "mxfp4_mma.tiled_layout"))


def expert_glu_decode_tiled(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``expert_glu_decode`` (the dispatched kernels, via ``tiled_layout``) on stacks ``w`` in
    ``expert_layout``'s tiles."""

    def kernel_for(glu, shape):
        return tiled_layout(dispatched_kernel(glu, shape))

    args = (backend, z, w, inds, weights, beta, cap)
    return _decode(kernel_for, template, dispatched_shape, *args)


# Both kernels' warp roles: row tile rt and split sk of the warp, lane (g, tq) of the MMA.
ROLES = """\
  const uint rt = warp % RT;
  const uint sk = warp / RT;
  const uint unit = GROUP_POS.x * RT + rt;
  const bool active = unit < UNITS;               // the whole warp agrees
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const bool bcol = g / 2 == tq;                  // this lane's B column is in its group
"""

# Both kernels' shape constants (template values RT, SK, GW, KD, NR, GLU).
CONSTANTS = """\
  constexpr int G = KD / 32;                                 // scale groups per row
  constexpr int NW = RT * SK;                                // warps
  constexpr int NB = GW / 4;                                 // 4-group blocks per step
  constexpr int GB = ((G + SK - 1) / SK + GW - 1) / GW * GW; // groups per split, whole steps
  constexpr int UNITS = GLU ? NR / 16 : NR / 32;             // row units (one warp's rows)
"""


def staging(frag: str, n: str, src: str, smax: str, sfx: str = "", shared: bool = False) -> str:
    """Code staging the ``n`` activations at ``src`` (a ``const DEVICE T*``, or with ``shared``
    a threadgroup float array) into ``frag`` as fp16 hi/lo B fragments, scaled by a power of
    two (largest |x| in [2^14, 2^15)); defines ``unscale<sfx>``, which undoes the scalings of
    a dot product. Fragment (block, p, column) holds codes 8p..8p+7 of the column's group
    (block * 4 + column / 2), hi for even columns, lo for odd. ``smax``: a threadgroup array
    of NW floats."""
    elem = f"{src}[i]" if shared else f"static_cast<float>({src}[i])"
    if shared:
        group, e8 = "", f"{src}[32 * grp + 8 * pq + e]"
    else:
        group, e8 = (
            f"    const DEVICE T* src = {src} + 32 * grp + 8 * pq;\n",
            "static_cast<float>(src[e])",
        )
    return f"""\\
  float m{sfx} = 0.0f;
  for (uint i = tid; i < {n}; i += 32 * NW) m{sfx} = FMAX(m{sfx}, FABS({elem}));
  m{sfx} = SIMD_MAX(m{sfx});
  if (lane == 0) {smax}[warp] = m{sfx};
  BARRIER();
  m{sfx} = {smax}[0];
  for (int w = 1; w < NW; ++w) m{sfx} = FMAX(m{sfx}, {smax}[w]);
  int n{sfx} = 141 - int((AS_UINT(m{sfx}) >> 23) & 255u);
  n{sfx} = n{sfx} > 127 ? 127 : (n{sfx} < -113 ? -113 : n{sfx});
  const float up{sfx} = AS_FLOAT(uint(n{sfx} + 127) << 23);
  const float unscale{sfx} = AS_FLOAT(uint(141 - n{sfx}) << 23);
  for (uint it = tid; it < ({n} / 32) * 8; it += 32 * NW) {{
    const uint col = it % 8;
    const uint pq = (it / 8) % 4;
    const uint grp = (it / 32) * 4 + col / 2;
{group}    float v[8];
    for (int e = 0; e < 8; ++e) v[e] = {e8} * up{sfx};
    if (col % 2) {{
      for (int e = 0; e < 8; ++e) v[e] -= ROUND_HALF(v[e]);
    }}
    {frag}[it] = UINT4(PACK_HALF2(v[0], v[4]), PACK_HALF2(v[1], v[5]), PACK_HALF2(v[2], v[6]),
                     PACK_HALF2(v[3], v[7]));
  }}
"""


# A row's groups are spread over its four lanes (tq): KK_LANES() adds them up.
LANES = """\
  // A row's groups are spread over its four lanes (tq): add them up.
#define KK_LANES()                                                                     \\
  {                                                                                    \\
    acc0 += SIMD_SHUFFLE_XOR(acc0, 1);                                                 \\
    acc1 += SIMD_SHUFFLE_XOR(acc1, 1);                                                 \\
    acc2 += SIMD_SHUFFLE_XOR(acc2, 1);                                                 \\
    acc3 += SIMD_SHUFFLE_XOR(acc3, 1);                                                 \\
    acc0 += SIMD_SHUFFLE_XOR(acc0, 2);                                                 \\
    acc1 += SIMD_SHUFFLE_XOR(acc1, 2);                                                 \\
    acc2 += SIMD_SHUFFLE_XOR(acc2, 2);                                                 \\
    acc3 += SIMD_SHUFFLE_XOR(acc3, 2);                                                 \\
  }
"""

# Both kernels stage the activations alike (``staging``): scaled by a power of two, split
# into fp16 hi and lo, in the MMA's B-fragment order (threadgroup array frag, all threads);
# 2^(14 - n) undoes both scalings.
STAGING = "  const DEVICE T* xr = x + (size_t)(GLU ? p / K : p) * KD;\n" + staging(
    "frag", "KD", "xr", "s_max"
)

# The epilogue's parameters (SiTU-GLU's beta and cap, or the pair's routing weight) go to
# threadgroup memory s_par before the staging's barrier: read from global memory in the
# epilogue instead, they slowed gate/up's streaming and the decode call
# (docs/benchmarks.md#mxfp4-decode-parameters).
PARAMS = """\
  if (tid == 0) {
    s_par[0] = params[GLU ? 0 : p];
    s_par[1] = GLU ? params[1] : 0.0f;
  }
"""

BODY = (
    "\n"
    + CONSTANTS
    + """\
  SHARED uint4 frag[G * 8];
  SHARED float red[SK * RT * 32];
  SHARED float s_max[NW];
  SHARED float s_par[2];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint p = GROUP_POS.y;

  // Four groups side by side: in a block of 4 scale groups, lane (g, tq) holds the whole group
  // tq of rows g and g + 8 of both tiles (one 128-bit load each), and the MMA's output
  // columns 2 tq, 2 tq + 1 (hi, lo) collect that group alone: B is zero outside a column's
  // group. So one 128-bit load, eight MMAs and one scale per row and group per lane.
"""
    + ROLES
    + """\
  const size_t ra = (size_t)inds[p] * NR + (GLU ? 16 : 32) * (active ? unit : 0) + g;
  const size_t rb = GLU ? ra : ra + 16;
  const DEVICE uint4* qa = (const DEVICE uint4*)w_a + ra * G + tq;
  const DEVICE uint4* qb = (const DEVICE uint4*)w_b + rb * G + tq;
  const DEVICE uint8_t* ea = s_a + ra * G + tq;
  const DEVICE uint8_t* eb = s_b + rb * G + tq;
  const uint b0 = sk * GB;
  const uint b1 = b0 + GB < G ? b0 + GB : G;
  const bool work = active && b0 < b1;            // the whole warp agrees
  // One step: per block, the lane's group of A row g, g+8, B row g, g+8 and their scales.
  // CS: the code words are loaded as read once (evict first).
#define KK_Q(q, i) (CS ? LOAD_STREAM(&(q)[i]) : (q)[i])
#define KK_LOAD(q, sc, bb)                                                          \\
  {                                                                                 \\
    _Pragma("unroll") for (int u = 0; u < NB; ++u) {                                \\
      q[4 * u] = KK_Q(qa, (bb) + 4 * u);                                            \\
      q[4 * u + 1] = KK_Q(qa, 8 * G + (bb) + 4 * u);                                \\
      q[4 * u + 2] = KK_Q(qb, (bb) + 4 * u);                                        \\
      q[4 * u + 3] = KK_Q(qb, 8 * G + (bb) + 4 * u);                                \\
      sc[4 * u] = ea[(bb) + 4 * u];                                                 \\
      sc[4 * u + 1] = ea[8 * G + (bb) + 4 * u];                                     \\
      sc[4 * u + 2] = eb[(bb) + 4 * u];                                             \\
      sc[4 * u + 3] = eb[8 * G + (bb) + 4 * u];                                     \\
    }                                                                               \\
  }
  uint4 qx[4 * NB], qy[4 * NB];
  uint sx[4 * NB], sy[4 * NB];
  if (work) KK_LOAD(qx, sx, b0);
"""
    + PARAMS
    + STAGING
    + """  BARRIER();

  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // A row g, g+8; B row g, g+8
  // A block's eight MMAs per tile: word pq of the lane's group gives the k-pairs (codes
  // j, j + 4) j = 0, 1 of one MMA and j = 2, 3 of the next; then each row's result (its
  // group's hi and lo columns) times the group's scale.
"""
    + STEP_MACRO
    + """  // PP: two register buffers take turns, a step's loads go out before the previous one's
  // math. Without it each step loads then computes (fewer registers, more warps resident).
  if (work && !PP) {
    for (uint b = b0; b < b1; b += GW) {
      if (b > b0) KK_LOAD(qx, sx, b);
      KK_STEP(qx, sx, frag, b, NB);
    }
  }
  if (work && PP) {
    for (uint b = b0; b < b1; b += 2 * GW) {
      const bool second = b + GW < b1;            // the whole warp agrees
      if (second) KK_LOAD(qy, sy, b + GW);
      KK_STEP(qx, sx, frag, b, NB);
      if (second) {
        if (b + 2 * GW < b1) KK_LOAD(qx, sx, b + 2 * GW);
        KK_STEP(qy, sy, frag, b + GW, NB);
      }
    }
  }
#undef KK_Q
#undef KK_LOAD
#undef KK_STEP
"""
    + LANES
    + """  KK_LANES();
  if (tq == 0) {
    red[(sk * RT + rt) * 32 + g] = acc0;
    red[(sk * RT + rt) * 32 + 8 + g] = acc1;
    red[(sk * RT + rt) * 32 + 16 + g] = acc2;
    red[(sk * RT + rt) * 32 + 24 + g] = acc3;
  }
  BARRIER();

  // Entry i of a unit's 32 sums: tile A rows 0-15, then tile B rows 0-15.
  const uint ru = tid / 32;
  const uint i = tid % 32;
  const uint unit_out = GROUP_POS.x * RT + ru;
  if ((int)tid < RT * 32 && unit_out < UNITS) {
    if (GLU) {
      if (i < 16) {
        float gate = 0.0f, upv = 0.0f;
        for (int s = 0; s < SK; ++s) {
          gate += red[(s * RT + ru) * 32 + i];
          upv += red[(s * RT + ru) * 32 + 16 + i];
        }
        out[(size_t)p * NR + 16 * unit_out + i] =
            kk_situ_glu(gate * unscale, upv * unscale, s_par[0], s_par[1]);
      }
    } else {
      float total = 0.0f;
      for (int s = 0; s < SK; ++s) total += red[(s * RT + ru) * 32 + i];
      out[(size_t)p * NR + 32 * unit_out + i] = s_par[0] * (total * unscale);
    }
  }
"""
)

U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32

# Warps per threadgroup as row tiles (RT) x splits of a row's groups (SK), scale groups per
# step (GW: 4 or 8), and whether a step's loads go out during the previous step (PP).
LAUNCH = {"gate_up": (8, 1, 8, True), "down": (8, 1, 8, True)}
# Code words loaded as read once (CS; LOAD_STREAM, CUDA's ld.global.cs) per projection: on
# the H200 they made gate/up faster and down slower (docs/benchmarks.md#mxfp4-decode-parameters).
STREAM_LOADS = {"gate_up": True, "down": False}


# Threadgroups per SM that the compiler must leave room for (CUDA's __launch_bounds__; 1:
# no bound). Unbounded, a 256-thread threadgroup of either projection takes 129-158
# registers and runs alone on an SM; a bound of 2 caps it at 128 so two fit.
MIN_BLOCKS = {"gate_up": 2, "down": 2}
# How the codes become fp16 per projection: "byte permute" (kk_e2m1_pair_prmt,
# byte_permute_decode) or "shift" (kk_e2m1_pair). With both bounded to 2 per SM, byte
# permutes won for gate/up in every round (128 registers, no spill, where shifts spill) and
# tied or won for down (docs/benchmarks.md#mxfp4-decode-parameters).
DECODE = {"gate_up": "byte permute", "down": "byte permute"}
DECODES = ("shift", "byte permute")


def _proj(glu: bool) -> str:
    """The projection's key in ``LAUNCH``, ``STREAM_LOADS``, ``MIN_BLOCKS``."""
    return "gate_up" if glu else "down"


def projection_template(dtype, KD, NR, K, glu) -> list:
    """The template values every decode projection kernel starts with: the activations'
    dtype, inner and output widths, choices per token, gate/up (or down)."""
    return [("T", dtype), ("KD", KD), ("NR", NR), ("K", K), ("GLU", glu)]


def template(dtype, KD, NR, K, glu, rt, sk, gw, pp=True, cs=None):
    return projection_template(dtype, KD, NR, K, glu) + [
        ("RT", rt),
        ("SK", sk),
        ("GW", gw),
        ("PP", pp),
        ("CS", STREAM_LOADS[_proj(glu)] if cs is None else cs),
    ]


def _instances(template_fn, launch) -> list:
    """The launches the dispatcher makes at K3's size: gate/up for each latent dtype, down."""
    gu = [
        Instance(
            [dt, U32, U8, U32, U8, I32, F32],
            [F32],
            template_fn(dt, K3["D"], K3["I"], 16, True, *launch["gate_up"]),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]
    down = Instance(
        [F32, U32, U8, U32, U8, I32, F32],
        [F32],
        template_fn(F32, K3["I"], K3["D"], 16, False, *launch["down"]),
    )
    return gu + [down]


INPUTS = ["x", "w_a", "s_a", "w_b", "s_b", "inds", "params"]
MXFP4_MMA = Kernel(
    "mxfp4_mma", INPUTS, ["out"], BODY, header=MMA_HEADER, instances=_instances(template, LAUNCH)
)


def _whole_steps(KD, shape):
    """``shape`` with 4-group steps where KD's groups are no multiple of its GW (eligible()
    guarantees multiples of 4 groups)."""
    rt, sk, gw, last = shape
    return (rt, sk, 4 if (KD // 32) % gw else gw, last)


def _launch(kernel, template_fn, shape, backend, x, wa, sa, wb, sb, inds, params, KD, NR, k, glu):
    """One projection for every (token, choice) pair: gate/up + SiTU-GLU, or down."""
    rt, sk = shape[:2]
    units = NR // 16 if glu else NR // 32
    pairs = inds.size
    (out,) = kernel(
        backend,
        inputs=[x, wa, sa, wb, sb, inds, params],
        output_shapes=[(pairs, NR)],
        output_dtypes=[F32],
        grid=(32 * rt * sk * -(-units // rt), pairs, 1),
        threadgroup=(32 * rt * sk, 1, 1),
        template=template_fn(x.dtype, KD, NR, k, glu, *shape),
    )
    return out


def _decode(kernel_for, template_fn, shape_for, backend, z, w, inds, weights, beta, cap):
    """Both projections through ``kernel_for(glu, shape)`` at ``shape_for(backend, KD,
    glu)``, then the ordered sum."""
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)

    def project(x, wa, sa, wb, sb, params, KD, NR, glu):
        shape = shape_for(backend, KD, glu)
        args = (x, wa, sa, wb, sb, flat, params, KD, NR, k, glu)
        return _launch(kernel_for(glu, shape), template_fn, shape, backend, *args)

    h = project(z, *w["w1"], *w["w3"], constant((beta, cap)), D, I, True)
    wts = weights.reshape(-1).astype(F32)
    part = project(h, *w["w2"], *w["w2"], wts, I, D, False)
    return sum_pairs(backend, part, N, k)


def dispatched_shape(backend, KD: int, glu: bool) -> tuple:
    """The launch shape ``expert_glu_decode`` uses for a projection of inner width KD."""
    return _whole_steps(KD, LAUNCH[_proj(glu)])


def dispatched_kernel(glu: bool, shape: tuple) -> Kernel:
    """The kernel ``expert_glu_decode`` launches for a projection at ``shape``: bounded by
    ``MIN_BLOCKS``, decoding as ``DECODE`` says (an unknown value is refused by key)."""
    proj = _proj(glu)
    if DECODE[proj] not in DECODES:
        raise ValueError(f"mxfp4_mma.DECODE[{proj!r}] = {DECODE[proj]!r}: one of {DECODES}")
    kernel = MXFP4_MMA.bounded(32 * shape[0] * shape[1], MIN_BLOCKS[proj])
    return byte_permute_decode(kernel) if DECODE[proj] == "byte permute" else kernel


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``mxfp4_decode.expert_glu_decode`` with tensor-core dot products (same shapes and
    return: fp32 [N, D]). Needs ``eligible`` inputs."""
    args = (backend, z, w, inds, weights, beta, cap)
    return _decode(dispatched_kernel, template, dispatched_shape, *args)


# What the dispatcher runs (before its launch bound), at module level so that the tests
# that find every kernel (tests/test_cuda_compile.py) compile it too.
MXFP4_MMA_PRMT = byte_permute_decode(MXFP4_MMA)


def eligible(z, w, inds) -> bool:
    """What ``mxfp4_decode.eligible`` accepts, with D and I multiples of 128 (scale bytes read
    four at a time) and the activations' fragments within threadgroup memory."""
    if not mxfp4_decode.eligible(z, w, inds):
        return False
    return eligible_dims(z.shape[-1], w["w1"][0].shape[-2])


def eligible_dims(D: int, I: int) -> bool:
    """``eligible``'s condition on the dims alone."""
    return D % 128 == 0 and I % 128 == 0 and 4 * max(D, I) <= 24 * 1024
