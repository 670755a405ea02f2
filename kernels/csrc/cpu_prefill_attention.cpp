// Prompt attention in bfloat16 on CPUs with AVX512-BF16 (built into every library, chosen at run time
// by the caller through has_bf16_dot): one prompt chunk of one sequence, causal, its keys and values
// read through the block table from the paged cache. Flash attention's loop on the CPU: for a tile of
// at most six query rows, 64 keys at a time, scores by vdpbf16ps (32 products an instruction, summed
// in float32), online softmax in float32, then the probabilities rounded to bfloat16 (as GPU flash
// attention rounds P) and the values accumulated by vdpbf16ps over pairs of keys into float32. The
// row sums come from the unrounded probabilities; the output is rounded to bfloat16 once.
//
// Per call, each kv head's keys and values are packed once for the inner loops (zeros past the
// sequence, up to whole 64-key steps):
//   keys   [keys / 16][D / 2][16][2]: tile t, depth pair i, lane j: K[16t + j, 2i], K[16t + j, 2i + 1]
//   values [keys / 2][D][2]:          key pair p, depth d:           V[2p, d],     V[2p + 1, d]
// A query row is one (token, query head) of the kv head's group; a tile takes consecutive rows in
// token-major order, so with GQA 9:3 a tile is two tokens x three heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lanes.h"

bool cpu_has_bf16_dot();  // cpu_kernels.cpp

namespace {

constexpr int64_t STEP_KEYS = 64;  // keys of one online-softmax step: four registers of scores
constexpr int MAX_ROWS = 6;        // query rows of a tile: 6 x 4 accumulators + 4 operands + 1 broadcast

// Where one kv head's keys (or values) lie in the paged cache: key k at
// base + blocks[k / block_size] * block_stride + (k % block_size) * row_stride
struct PagedRows {
  const uint16_t* base;
  const int64_t* blocks;
  int64_t block_size, block_stride, row_stride;

  const uint16_t* row(int64_t k) const {
    return base + blocks[k / block_size] * block_stride + (k % block_size) * row_stride;
  }
};

void pack_keys(const PagedRows& k, int64_t keys, int64_t padded, int64_t head_dim, uint32_t* out) {
  const int64_t pairs = head_dim / 2;
  std::fill(out, out + padded * pairs, 0u);
  for (int64_t key = 0; key < keys; ++key) {
    const uint16_t* src = k.row(key);
    uint32_t* tile = out + (key / 16) * pairs * 16 + key % 16;
    for (int64_t i = 0; i < pairs; ++i) __builtin_memcpy(tile + i * 16, src + 2 * i, sizeof(uint32_t));
  }
}

void pack_values(const PagedRows& v, int64_t keys, int64_t padded, int64_t head_dim, uint16_t* out) {
  std::fill(out, out + padded * head_dim, uint16_t{0});
  for (int64_t key = 0; key < keys; ++key) {
    const uint16_t* src = v.row(key);
    uint16_t* dst = out + (key / 2) * head_dim * 2 + key % 2;
    for (int64_t d = 0; d < head_dim; ++d) dst[2 * d] = src[d];
  }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
#include <immintrin.h>

namespace {

// s[r][t] = scores of MR query rows against one step's 64 keys (four tiles of 16), unscaled
template <int MR>
void step_scores(const uint16_t* const* q, const uint32_t* keys, int64_t pairs, v16 (*s)[4]) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) w[t] = (__m512bh)_mm512_loadu_si512(keys + (t * pairs + i) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = broadcast_pair(q[r] + 2 * i);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, w[t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) s[r][t] = (v16)acc[r][t];
}

// o[r][16c : 16c + 16 NV] = o * rescale[r] + sum over the step's 32 key pairs p[r] . values, for NV
// registers of depth starting at `depth` (o: MR rows of head_dim floats; p: MR rows of 64 bfloat16)
template <int MR, int NV>
void step_values(const uint16_t (*p)[STEP_KEYS], const float* rescale, const uint16_t* values, int64_t head_dim,
                 int64_t depth, float* o) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * head_dim + depth + 16 * c), _mm512_set1_ps(rescale[r]));
  for (int64_t pair = 0; pair < STEP_KEYS / 2; ++pair) {
    __m512bh w[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      w[c] = (__m512bh)_mm512_loadu_si512(values + pair * head_dim * 2 + (depth + 16 * c) * 2);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = broadcast_pair(p[r] + 2 * pair);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * head_dim + depth + 16 * c, acc[r][c]);
}

// One tile of MR query rows of one kv head over keys 0..pos[r] (pos ascending), into out rows.
template <int MR>
void attend_tile(const uint16_t* const* q, const int64_t* pos, const uint32_t* keys, const uint16_t* values,
                 int64_t head_dim, float scale, uint16_t* const* out) {
  const int64_t pairs = head_dim / 2, steps = pos[MR - 1] / STEP_KEYS + 1;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 minus_inf = v16{} - std::numeric_limits<float>::infinity();
  alignas(64) float o[MR * 256];  // head_dim <= 256
  alignas(64) uint16_t p[MR][STEP_KEYS];
  float row_max[MR], denom[MR], rescale[MR];
  std::fill(o, o + MR * head_dim, 0.f);
  std::fill(row_max, row_max + MR, -std::numeric_limits<float>::infinity());
  std::fill(denom, denom + MR, 0.f);
  v16 s[MR][4];
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t first = step * STEP_KEYS;
    step_scores<MR>(q, keys + first * pairs, pairs, s);
    const bool masked = first + STEP_KEYS - 1 > pos[0];  // some key of the step lies past a row
    for (int r = 0; r < MR; ++r) {
      v16 m = minus_inf;
      for (int t = 0; t < 4; ++t) {
        s[r][t] *= scale;
        if (masked) s[r][t] = lane + static_cast<float>(first + 16 * t - pos[r]) <= 0.f ? s[r][t] : minus_inf;
        m = m > s[r][t] ? m : s[r][t];
      }
      const float new_max = std::max(row_max[r], max16(m));
      // a row with every key of the step past it keeps its state (its probabilities are all 0)
      rescale[r] = new_max > row_max[r] ? std::exp(row_max[r] - new_max) : 1.f;
      row_max[r] = new_max;
      v16 total = {};
      for (int t = 0; t < 4; ++t) {
        const v16 e = s[r][t] == minus_inf ? v16{} : exp_lanes<v16, i16>(s[r][t] - new_max);
        total += e;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&p[r][16 * t]), (__m256i)_mm512_cvtneps_pbh((__m512)e));
      }
      denom[r] = denom[r] * rescale[r] + sum16(total);
    }
    const uint16_t* step_values_at = values + first * head_dim;
    int64_t depth = 0;
    for (; depth + 64 <= head_dim; depth += 64) step_values<MR, 4>(p, rescale, step_values_at, head_dim, depth, o);
    if (depth < head_dim) step_values<MR, 2>(p, rescale, step_values_at, head_dim, depth, o);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * head_dim + d), inv)));
  }
}

using AttendTile = void (*)(const uint16_t* const*, const int64_t*, const uint32_t*, const uint16_t*, int64_t, float,
                            uint16_t* const*);

AttendTile attend_tile_for(int64_t rows) {
  switch (rows) {
    case 1: return attend_tile<1>;
    case 2: return attend_tile<2>;
    case 3: return attend_tile<3>;
    case 4: return attend_tile<4>;
    case 5: return attend_tile<5>;
    default: return attend_tile<6>;
  }
}

}  // namespace
#pragma GCC pop_options

// q [Lq, Hq, D] bfloat16 (D a multiple of 32, at most 256; Hq a multiple of Hkv): the last Lq tokens of
// a sequence of seq_len tokens, token j at position seq_len - Lq + j attending keys 0..that position.
// k_cache, v_cache [num_blocks, block_size, Hkv, D] bfloat16 (one layer's strided views, rows dense);
// blocks [>= ceil(seq_len / block_size)] int64: the sequence's blocks in order. Returns [Lq, Hq, D].
torch::Tensor prefill_attention_bf16(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     torch::Tensor blocks, int64_t seq_len, double scale) {
  TORCH_CHECK(cpu_has_bf16_dot(), "prefill_attention_bf16: this CPU has no AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
                  v_cache.scalar_type() == torch::kBFloat16 && q.dim() == 3 && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "prefill_attention_bf16: q [Lq, Hq, D] and caches [blocks, block_size, Hkv, D], bfloat16");
  const int64_t q_len = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && head_dim % 32 == 0 && head_dim <= 256 && num_heads % num_kv_heads == 0,
              "prefill_attention_bf16: head dim a multiple of 32 up to 256 and Hq a multiple of Hkv, got D=",
              head_dim, " Hq=", num_heads, " Hkv=", num_kv_heads);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "prefill_attention_bf16: cache rows must be dense");
  TORCH_CHECK(q_len >= 1 && seq_len >= q_len, "prefill_attention_bf16: ", q_len, " new tokens of a ", seq_len,
              "-token sequence");
  blocks = blocks.to(torch::kLong).contiguous();
  TORCH_CHECK(blocks.numel() * block_size >= seq_len, "prefill_attention_bf16: ", blocks.numel(),
              " blocks hold fewer than ", seq_len, " tokens");
  if (q.stride(2) != 1) q = q.contiguous();
  auto out = torch::empty({q_len, num_heads, head_dim}, q.options());
  const int64_t group = num_heads / num_kv_heads, padded = (seq_len + STEP_KEYS - 1) / STEP_KEYS * STEP_KEYS;
  auto key_pack = torch::empty({num_kv_heads, padded * head_dim / 2}, torch::kInt);
  auto value_pack = torch::empty({num_kv_heads, padded * head_dim}, torch::kBFloat16);
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* kpack = reinterpret_cast<uint32_t*>(key_pack.data_ptr());
  auto* vpack = reinterpret_cast<uint16_t*>(value_pack.data_ptr());
  const int64_t* bp = blocks.data_ptr<int64_t>();
  at::parallel_for(0, num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys({kp + h * k_cache.stride(2), bp, block_size, k_cache.stride(0), k_cache.stride(1)}, seq_len, padded,
                head_dim, kpack + h * padded * head_dim / 2);
      pack_values({vp + h * v_cache.stride(2), bp, block_size, v_cache.stride(0), v_cache.stride(1)}, seq_len,
                  padded, head_dim, vpack + h * padded * head_dim);
    }
  });
  // each kv head's Lq x group rows in tiles of at most MAX_ROWS, split evenly (8 rows run as 4 + 4)
  const int64_t rows = q_len * group, tiles = (rows + MAX_ROWS - 1) / MAX_ROWS;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t q_token = q.stride(0), q_head = q.stride(1), first_pos = seq_len - q_len;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, tile = item % tiles;
      const int64_t r0 = rows * tile / tiles, r1 = rows * (tile + 1) / tiles;
      const uint16_t* q_rows[MAX_ROWS];
      uint16_t* out_rows[MAX_ROWS];
      int64_t pos[MAX_ROWS];
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t token = r / group, head = h * group + r % group;
        q_rows[r - r0] = qp + token * q_token + head * q_head;
        out_rows[r - r0] = op + (token * num_heads + head) * head_dim;
        pos[r - r0] = first_pos + token;
      }
      attend_tile_for(r1 - r0)(q_rows, pos, kpack + h * padded * head_dim / 2, vpack + h * padded * head_dim,
                               head_dim, sc, out_rows);
    }
  });
  return out;
}

void register_prefill_attention(pybind11::module_& m) {
  m.def("prefill_attention_bf16", &prefill_attention_bf16,
        "causal attention of a prompt chunk over its paged keys, bfloat16 (AVX512-BF16 CPUs)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("blocks"), py::arg("seq_len"), py::arg("scale"));
}
