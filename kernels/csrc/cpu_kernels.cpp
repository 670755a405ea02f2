// The CPU twins of two Triton kernels, with the semantics of their torch references: paged decode
// attention (one new token per sequence, KV blocks read in place through the block table: no gather
// into a padded copy; float32 or bfloat16 caches, float32 math; for bfloat16 on AVX512-BF16 CPUs a
// second kernel that takes its scores and value sums with vdpbf16ps, chosen at run time) and the KV
// slot write.
// The bfloat16 GEMM lives in cpu_gemm.cpp and bfloat16 prompt attention in cpu_prefill_attention.cpp,
// both registered in this module. setup.py builds the three files
// (and kernels/cpu_ext.py as a fallback) with
// -DSPLITSERVE_SOURCE_DIGEST=d<sha256 of the sources>, which the module exports so that a library
// older than the source is never loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "lanes.h"

namespace {

// Eight floats: one AVX register, two SSE registers, whatever the compiler targets.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// bfloat16 widened to float32, a vector of F lanes (H: as many uint16, W: as many uint32); exact: a
// bfloat16 is the top half of a float32
template <typename F, typename H, typename W>
inline F widen_bf16(const at::BFloat16* p) {
  H h;
  __builtin_memcpy(&h, p, sizeof(h));
  const W w = __builtin_convertvector(h, W) << 16;
  F v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

inline v8 load8(const at::BFloat16* p) { return widen_bf16<v8, u16x8, u32x8>(p); }

typedef int32_t i8 __attribute__((vector_size(32)));

// eight floats rounded to bfloat16 precision (to nearest, ties to even; NaN to c10's quiet NaN), still
// as floats: what a bfloat16 torch op stores
inline v8 round_bf16(v8 x) {
  u32x8 b;
  __builtin_memcpy(&b, &x, sizeof(b));
  u32x8 r = (b + (((b >> 16) & 1) + 0x7FFFu)) & 0xFFFF0000u;
  const i8 nan = x != x;
  r = nan ? u32x8{} + 0x7FC00000u : r;
  v8 v;
  __builtin_memcpy(&v, &r, sizeof(v));
  return v;
}

// eight floats stored as bfloat16, rounded as above
inline void store8(at::BFloat16* p, v8 v) {
  u32x8 b;
  const v8 r = round_bf16(v);
  __builtin_memcpy(&b, &r, sizeof(b));
  const u16x8 h = __builtin_convertvector(b >> 16, u16x8);
  __builtin_memcpy(p, &h, sizeof(h));
}

inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline v8 exp8(v8 x) { return exp_lanes<v8, i8>(x); }

// <a, b> over n values, n a multiple of 8
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  v8 acc = {};
  for (int64_t d = 0; d < n; d += 8) acc += load8(a + d) * load8(b + d);
  return hsum8(acc);
}

// out[i] = <q, k + i * stride> for i < 4: each chunk of q is loaded once for four rows
template <typename T>
inline void dots4(const float* q, const T* k, int64_t stride, int64_t n, float* out) {
  v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t d = 0; d < n; d += 8) {
    const v8 qd = load8(q + d);
    a0 += qd * load8(k + d);
    a1 += qd * load8(k + stride + d);
    a2 += qd * load8(k + 2 * stride + d);
    a3 += qd * load8(k + 3 * stride + d);
  }
  out[0] = hsum8(a0);
  out[1] = hsum8(a1);
  out[2] = hsum8(a2);
  out[3] = hsum8(a3);
}

// The three levels of a transpose-reduce: lane i of the result of all three holds the sum of
// input vector i (eight horizontal sums for the price of seven shuffle pairs).
inline v8 pair_sums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

inline v8 quad_sums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
         __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}

inline v8 oct_sums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}

// lane i = <q, k + i * stride> for i < 8, n a multiple of 8: each chunk of q is loaded once
template <typename T>
inline v8 dots8(const float* q, const T* k, int64_t stride, int64_t n) {
  v8 a[8] = {};
  for (int64_t d = 0; d < n; d += 8) {
    const v8 qd = load8(q + d);
    for (int i = 0; i < 8; ++i) a[i] += qd * load8(k + i * stride + d);
  }
  return oct_sums(quad_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3])),
                  quad_sums(pair_sums(a[4], a[5]), pair_sums(a[6], a[7])));
}

// acc[g] = acc[g] * rescale[g] + sum_t s[g][t] * v[t] for the G query heads of one kv head, over
// CH chunks of eight lanes at `d`: each value chunk is loaded once for all G, and the G x CH
// accumulators are independent (one FMA chain per chunk and head, not one per head over t), so they
// stay in registers and the FMAs overlap
template <int G, int CH, typename T>
inline void accumulate_tile(const float* s, int64_t s_stride, const float* rescale, const T* v, int64_t v_row,
                            int64_t n, int64_t head_dim, int64_t d, float* acc) {
  v8 c[G][CH];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) c[g][i] = load8(acc + g * head_dim + d + 8 * i) * rescale[g];
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * v_row + d;
    for (int i = 0; i < CH; ++i) {
      const v8 vd = load8(vt + 8 * i);
      for (int g = 0; g < G; ++g) c[g][i] += s[g * s_stride + t] * vd;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < CH; ++i) store8(acc + g * head_dim + d + 8 * i, c[g][i]);
}

// The whole head, in tiles of 64 lanes for G <= 2 and 32 above (at most 16 accumulators), then any
// rest 8 lanes at a time
template <int G, typename T>
inline void accumulate_values(const float* s, int64_t s_stride, const float* rescale, const T* v,
                              int64_t v_row, int64_t n, int64_t head_dim, float* acc) {
  constexpr int CH = G <= 2 ? 8 : 4;
  int64_t d = 0;
  for (; d + 8 * CH <= head_dim; d += 8 * CH)
    accumulate_tile<G, CH>(s, s_stride, rescale, v, v_row, n, head_dim, d, acc);
  for (; d < head_dim; d += 8) accumulate_tile<G, 1>(s, s_stride, rescale, v, v_row, n, head_dim, d, acc);
}

// rows [0, n) of `head_dim` values at `src` (row stride `src_row`) widened into `dst` (dense rows):
// a bfloat16 key block is widened once per kv head, not once per query head of its group
template <typename T>
inline void widen_rows(const T* src, int64_t src_row, int64_t n, int64_t head_dim, float* dst) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < head_dim; d += 8) store8(dst + t * head_dim + d, load8(src + t * src_row + d));
}

inline float max_of(const float* x, int64_t n) {
  int64_t t = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= 8) {
    v8 mv = load8(x);
    for (t = 8; t + 8 <= n; t += 8) {
      const v8 v = load8(x + t);
      mv = mv > v ? mv : v;
    }
    for (int i = 0; i < 8; ++i) m = std::max(m, mv[i]);
  }
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// Prefetch slice `part` of `parts` of the n values at p (whole 64-byte lines) into L2, not L1: a
// K/V block is 2 x 8 KiB at the benchmark shape, and fetching the next ones into a 32 KiB L1 evicts
// the block being read (2x slower, measured).
//
// Always inlined, as is every function that calls it for nothing else (ALWAYS_INLINE): GCC counts a
// prefetch as no side effect, so a function that only prefetches is "pure" and a call to it whose
// result goes unused is deleted. BlockWalk::ahead was, from its first version until session 32: the
// library held no prefetch outside the walk's constructor, and the decode kernels met every block
// after the first two cold from DRAM (tests/kernels/test_prebuilt.py now looks for them).
#define ALWAYS_INLINE __attribute__((always_inline)) inline
template <typename T>
ALWAYS_INLINE void prefetch_slice(const T* p, int64_t n, int64_t part, int64_t parts) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t lines = (n * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; ++i)
    __builtin_prefetch(bytes + i * 64, /*rw=*/0, /*locality=*/2);
}

constexpr size_t kPrefetchAhead = 2;  // blocks: ~1 us of work each, a DRAM latency is ~0.1 us

}  // namespace

// [T, H, D] with each token's heads one dense run (any stride between tokens)
static inline bool dense_heads(const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); }

// one layer's K and V cache views of `dtype`, [num_blocks, block_size, Hkv, D] with dense rows
static void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::ScalarType dtype,
                         const char* name) {
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, name, " (cpu): ",
              c10::toString(dtype), " caches only");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && v_cache.stride(3) == 1 &&
                  v_cache.stride(2) == v_cache.size(3),
              name, " (cpu): each cache row [Hkv, D] must be dense");
}

namespace {

// float32 or bfloat16 (every tensor of one call the same), the two dtypes the kernels below take
bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// `body(T{})` with T = float for a float32 `t`, at::BFloat16 otherwise (callers check the dtype first)
template <typename F>
auto by_dtype(const torch::Tensor& t, F&& body) {
  if (t.scalar_type() == torch::kFloat) return body(float{});
  return body(at::BFloat16{});
}

// `x` as a value of T and back: identity for float32, bfloat16's round to nearest even otherwise.
// The bfloat16 kernels round where torch's bfloat16 ops (Hugging Face's order of operations) round.
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
inline v8 rounded(v8 x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return round_bf16(x);
}

}  // namespace

namespace {

// What every decode kernel below shares: the split of a batch over threads and the order blocks are
// read in. Each thread takes a contiguous run of sequences holding ~1/threads of the keys (lengths
// differ) and reads each K/V block whole, once; while it reads one, the block kPrefetchAhead later
// is prefetched into L2 a slice at a time (`ahead`).
template <typename T>
struct BlockWalk {
  const T* k;
  const T* v;
  int64_t k_block, v_block, k_bytes, v_bytes;  // block strides; elements to prefetch per block
  int64_t first_seq = 0, end_seq = 0;
  std::vector<int64_t> visits;  // this thread's blocks, in order, across its sequences

  BlockWalk(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int32_t* tables, int64_t width,
            const int32_t* lens, int64_t first, int64_t end)
      : k(k_cache.data_ptr<T>()),
        v(v_cache.data_ptr<T>()),
        k_block(k_cache.stride(0)),
        v_block(v_cache.stride(0)),
        k_bytes(k_cache.size(1) * k_cache.stride(1)),
        v_bytes(v_cache.size(1) * v_cache.stride(1)),
        first_seq(first),
        end_seq(end) {
    const int64_t block_size = k_cache.size(1);
    for (int64_t b = first_seq; b < end_seq; ++b)
      for (int64_t i = 0; i * block_size < lens[b]; ++i) visits.push_back(tables[b * width + i]);
    for (size_t i = 0; i < kPrefetchAhead && i < visits.size(); ++i) {
      prefetch_slice(k + visits[i] * k_block, k_bytes, 0, 1);
      prefetch_slice(v + visits[i] * v_block, v_bytes, 0, 1);
    }
  }

  // slice `part` of `parts` of the block kPrefetchAhead after visit `visit`, if there is one
  ALWAYS_INLINE void ahead(size_t visit, int64_t part, int64_t parts) const {
    if (visit + kPrefetchAhead >= visits.size()) return;
    const int64_t next = visits[visit + kPrefetchAhead];
    prefetch_slice(k + next * k_block, k_bytes, part, parts);
    prefetch_slice(v + next * v_block, v_bytes, part, parts);
  }
};

// `body(walk)` on each thread with its BlockWalk
template <typename T, typename Body>
void for_each_walk(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, Body&& body) {
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> bounds(num_seqs + 1, 0);
  for (int64_t b = 0; b < num_seqs; ++b) bounds[b + 1] = bounds[b] + lens[b] + 1;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_seqs));
  at::parallel_for(0, threads, 1, [&](int64_t first_slot, int64_t end_slot) {
    const auto seq_at = [&](int64_t slot) {
      return std::lower_bound(bounds.begin(), bounds.end(), bounds.back() * slot / threads) - bounds.begin();
    };
    BlockWalk<T> walk(k_cache, v_cache, block_tables.data_ptr<int32_t>(), block_tables.size(1), lens,
                      seq_at(first_slot), seq_at(end_slot));
    body(walk);
  });
}

// One sequence's online-softmax state over its query heads, float32: the running max and
// denominator per head and the unnormalized output rows
struct SoftmaxRows {
  std::vector<float> acc, row_max, denom;
  int64_t head_dim;

  SoftmaxRows(int64_t num_heads, int64_t head_dim_)
      : acc(num_heads * head_dim_), row_max(num_heads), denom(num_heads), head_dim(head_dim_) {}

  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(denom.begin(), denom.end(), 0.f);
  }

  // the normalized rows, [num_heads, head_dim] of T at `out`
  template <typename T>
  void write(T* out) const {
    for (size_t hq = 0; hq < denom.size(); ++hq)
      for (int64_t d = 0; d < head_dim; ++d)
        out[hq * head_dim + d] = static_cast<T>(acc[hq * head_dim + d] / denom[hq]);
  }
};

}  // namespace

// T: the element type of q, the caches and the output (float or at::BFloat16); scores, softmax and
// the accumulators are float32 either way, as in the torch reference.
template <typename T>
static void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                             torch::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2), q_token = q.stride(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const T* qp = q.data_ptr<T>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t k_row = k_cache.stride(1), v_row = v_cache.stride(1);
  const float sc = static_cast<float>(scale);
  // query heads that share each value row loaded (a kv head's group, or a divisor of it)
  const int64_t heads_per_pass = group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;

  // the `group` query heads of a kv head share every row loaded
  for_each_walk<T>(k_cache, v_cache, block_tables, seq_lens, [&](const BlockWalk<T>& walk) {
    const int64_t padded = (block_size + 7) / 8 * 8;  // score rows in whole v8 lanes
    std::vector<float> qs(num_heads * head_dim), scores(num_heads * padded), rescale(num_heads);
    std::vector<float> keys(std::is_same_v<T, float> ? 0 : block_size * head_dim);  // one kv head's block
    SoftmaxRows rows(num_heads, head_dim);
    std::vector<float>&acc = rows.acc, &row_max = rows.row_max, &denom = rows.denom;
    size_t visit = 0;
    for (int64_t b = walk.first_seq; b < walk.end_seq; ++b) {
      const int64_t len = lens[b];
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qs[i] = static_cast<float>(qp[b * q_token + i]) * sc;
      rows.reset();
      for (int64_t start = 0; start < len; start += block_size, ++visit) {
        const int64_t block = walk.visits[visit], n = std::min(block_size, len - start);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          walk.ahead(visit, hq, num_heads);
          const int64_t h = hq / group;
          const T* block_keys = walk.k + block * walk.k_block + h * head_dim;
          const float* kb;
          int64_t kr;
          if constexpr (std::is_same_v<T, float>) {
            kb = block_keys, kr = k_row;
          } else {
            if (hq % group == 0) widen_rows(block_keys, k_row, n, head_dim, keys.data());
            kb = keys.data(), kr = head_dim;
          }
          const float* qh = qs.data() + hq * head_dim;
          float* s = scores.data() + hq * padded;
          int64_t t = 0;
          for (; t + 8 <= n; t += 8) store8(s + t, dots8(qh, kb + t * kr, kr, head_dim));
          for (; t + 4 <= n; t += 4) dots4(qh, kb + t * kr, kr, head_dim, s + t);
          for (; t < n; ++t) s[t] = dot(qh, kb + t * kr, head_dim);
          // online softmax: rescale what was accumulated to this block's running max
          const float new_max = std::max(row_max[hq], max_of(s, n));
          // the running max settles early in a sequence: skip the exp while it holds
          rescale[hq] = new_max > row_max[hq] ? std::exp(row_max[hq] - new_max) : 1.f;
          row_max[hq] = new_max;
          for (t = 0; t < n; t += 8) store8(s + t, exp8(load8(s + t) - new_max));
          denom[hq] = denom[hq] * rescale[hq] + std::accumulate(s, s + n, 0.f);
        }
        for (int64_t hq = 0; hq < num_heads; hq += heads_per_pass) {
          const T* vb = walk.v + block * walk.v_block + (hq / group) * head_dim;
          const float* s = scores.data() + hq * padded;
          float* a = acc.data() + hq * head_dim;
          const float* r = &rescale[hq];
          if (heads_per_pass == 4) accumulate_values<4>(s, padded, r, vb, v_row, n, head_dim, a);
          else if (heads_per_pass == 3) accumulate_values<3>(s, padded, r, vb, v_row, n, head_dim, a);
          else if (heads_per_pass == 2) accumulate_values<2>(s, padded, r, vb, v_row, n, head_dim, a);
          else accumulate_values<1>(s, padded, r, vb, v_row, n, head_dim, a);
        }
      }
      rows.write(op + b * num_heads * head_dim);
    }
  });
}

// The bfloat16 decode kernel on CPUs with AVX512-BF16 (built into every library, chosen at run time):
// scores are `vdpbf16ps` dot products of the bfloat16 query and key rows as they lie in the cache
// (exact products summed in float32: no widened copy of the keys, 32 products an instruction), then
// scaled; softmax is float32 over 16 lanes, as in the generic kernel; the values are summed by
// vdpbf16ps over pairs of tokens into float32, the probabilities rounded to bfloat16 for it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
#include <immintrin.h>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// lane i = the sum of the lanes of v[i], i < 16 (a transpose-reduce: 15 shuffle pairs, not 16 sums)
inline v16 lane_sums16(const v16* v) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)
    l1[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                    30) +
            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                    31);
  for (int i = 0; i < 4; ++i)
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                    29) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                    31);
  for (int i = 0; i < 2; ++i)
    l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                    27) +
            __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                    31);
  return __builtin_shufflevector(l3[0], l3[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(l3[0], l3[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

inline __m512bh load_bh(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

// lanes t < n of the result = <q, k + t * k_row> over DC x 32 values, the rest 0: one vdpbf16ps per
// 32 values, each key row loaded once
template <int DC>
inline v16 scores16(const __m512bh* q, const at::BFloat16* k, int64_t k_row, int64_t n) {
  v16 acc[16];
  for (int t = 0; t < 16; ++t) {
    __m512 a = _mm512_setzero_ps();
    if (t < n)
      for (int c = 0; c < DC; ++c) a = _mm512_dpbf16_ps(a, q[c], load_bh(k + t * k_row + 32 * c));
    acc[t] = reinterpret_cast<v16>(a);
  }
  return lane_sums16(acc);
}

// acc[g] = acc[g] * rescale[g] + sum_{t < n} p[g][t] * v[t] for G heads over the 32-value chunks
// [c0, c0 + CC) of the head, by vdpbf16ps over pairs of tokens: p in bfloat16 (rounded as GPU flash
// attention rounds its probabilities), two value rows interleaved by vpunpck{l,h}wd. The interleave
// works within 128-bit lanes, so each chunk's accumulators hold its values in `paired` order (lane i of
// the low half: value 8 (i / 4) + i % 4; of the high half: that + 4), which `unpair` undoes once a
// sequence is done. An odd last token pairs with zeros; rows at or past n are never read.
template <int G, int CC>
inline void accumulate_pairs(const uint16_t (*p)[16], const float* rescale, const at::BFloat16* v, int64_t v_row,
                             int64_t n, int64_t head_dim, int64_t c0, float* acc) {
  __m512 c[G][2 * CC];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * CC; ++i)
      c[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * head_dim + 32 * c0 + 16 * i), _mm512_set1_ps(rescale[g]));
  for (int64_t t = 0; t < n; t += 2) {
    __m512bh w[2 * CC];
    for (int i = 0; i < CC; ++i) {
      const __m512i a = _mm512_loadu_si512(v + t * v_row + 32 * (c0 + i));
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * v_row + 32 * (c0 + i)) : _mm512_setzero_si512();
      w[2 * i] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      w[2 * i + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh pp = broadcast_pair(p[g] + t);
      for (int i = 0; i < 2 * CC; ++i) c[g][i] = _mm512_dpbf16_ps(c[g][i], pp, w[i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * CC; ++i) _mm512_storeu_ps(acc + g * head_dim + 32 * c0 + 16 * i, c[g][i]);
}

// `accumulate_pairs`' order back to the natural one, for rows of head_dim floats
inline void unpair(float* acc, int64_t rows, int64_t head_dim) {
  for (int64_t c = 0; c < rows * head_dim; c += 32) {
    float paired[32];
    std::copy(acc + c, acc + c + 32, paired);
    for (int i = 0; i < 16; ++i) {
      acc[c + 8 * (i / 4) + i % 4] = paired[i];
      acc[c + 8 * (i / 4) + 4 + i % 4] = paired[16 + i];
    }
  }
}

// One sequence's G query heads of one kv head over a block's first n <= 16 rows, online softmax:
// row_max/denom/acc carry the running state from the blocks before.
template <int G, int DC>
inline void attend_block16(const __m512bh (*q)[DC], float scale, const at::BFloat16* k, int64_t k_row,
                           const at::BFloat16* v, int64_t v_row, int64_t n, float* row_max, float* denom,
                           float* acc) {
  constexpr int64_t head_dim = 32 * DC;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const auto valid = lane < static_cast<float>(n);
  const v16 minus_inf = v16{} - std::numeric_limits<float>::infinity();
  alignas(64) uint16_t p[G][16];  // bfloat16
  float rescale[G];
  for (int g = 0; g < G; ++g) {
    const v16 s = valid ? scores16<DC>(q[g], k, k_row, n) * scale : minus_inf;
    const float new_max = std::max(row_max[g], max16(s));
    rescale[g] = new_max > row_max[g] ? std::exp(row_max[g] - new_max) : 1.f;
    row_max[g] = new_max;
    const v16 e = valid ? exp_lanes<v16, i16>(s - new_max) : v16{};
    denom[g] = denom[g] * rescale[g] + sum16(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p[g]), (__m256i)_mm512_cvtneps_pbh((__m512)e));
  }
  // at most 16 accumulators of 16 lanes live at once, chunks that divide the head
  constexpr int CC = std::min(DC, G <= 2 ? 4 : G <= 4 ? 2 : 1);
  for (int64_t c0 = 0; c0 < DC; c0 += CC) accumulate_pairs<G, CC>(p, rescale, v, v_row, n, head_dim, c0, acc);
}

}  // namespace

// q [B, Hq, D] bfloat16 with D a multiple of 32 and D <= 128, block_size <= 16; caches bfloat16
template <int G, int DC>
static void decode_attention_bf16dot(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  using T = at::BFloat16;
  constexpr int64_t head_dim = 32 * DC;
  const int64_t num_heads = q.size(1), q_token = q.stride(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, passes = num_heads / G;
  const T* qp = q.data_ptr<T>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t k_row = k_cache.stride(1), v_row = v_cache.stride(1);
  const float sc = static_cast<float>(scale);
  for_each_walk<T>(k_cache, v_cache, block_tables, seq_lens, [&](const BlockWalk<T>& walk) {
    SoftmaxRows rows(num_heads, head_dim);
    size_t visit = 0;
    for (int64_t b = walk.first_seq; b < walk.end_seq; ++b) {
      const int64_t len = lens[b];
      rows.reset();
      for (int64_t start = 0; start < len; start += block_size, ++visit) {
        const int64_t block = walk.visits[visit], n = std::min(block_size, len - start);
        for (int64_t pass = 0; pass < passes; ++pass) {
          walk.ahead(visit, pass, passes);
          const int64_t hq = pass * G, h = hq / group;
          __m512bh qh[G][DC];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < DC; ++c) qh[g][c] = load_bh(qp + b * q_token + (hq + g) * head_dim + 32 * c);
          attend_block16<G, DC>(qh, sc, walk.k + block * walk.k_block + h * head_dim, k_row,
                                walk.v + block * walk.v_block + h * head_dim, v_row, n, &rows.row_max[hq],
                                &rows.denom[hq], rows.acc.data() + hq * head_dim);
        }
      }
      unpair(rows.acc.data(), num_heads, head_dim);
      rows.write(op + b * num_heads * head_dim);
    }
  });
}

#pragma GCC pop_options

// Whether this CPU runs decode_attention_bf16dot and bf16_linear (cpu_gemm.cpp): AVX512-BF16, as on Cooper
// Lake, Sapphire Rapids, Zen 4 and later
bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
}

// decode_attention_bf16dot for q's shape, or false where it has no instance (the generic kernel runs)
static bool try_bf16_dot(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                         torch::Tensor& out) {
  const int64_t head_dim = q.size(2), group = q.size(1) / k_cache.size(2);
  if (q.scalar_type() != torch::kBFloat16 || k_cache.size(1) > 16 || !cpu_has_bf16_dot()) return false;
  const auto by_group = [&](auto dc) {
    constexpr int DC = decltype(dc)::value;
    if (group % 4 == 0) decode_attention_bf16dot<4, DC>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    else if (group % 3 == 0) decode_attention_bf16dot<3, DC>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    else if (group % 2 == 0) decode_attention_bf16dot<2, DC>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    else decode_attention_bf16dot<1, DC>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    return true;
  };
  if (head_dim == 64) return by_group(std::integral_constant<int, 2>{});
  if (head_dim == 128) return by_group(std::integral_constant<int, 4>{});
  if (head_dim == 32) return by_group(std::integral_constant<int, 1>{});
  return false;
}

// q [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] views whose last two dims are
// dense, of q's dtype (float32 or bfloat16); block_tables [B, W] int32; seq_lens [B] int32 (keys
// per sequence, the new one included). Returns [B, Hq, D] of q's dtype. `bf16_dot`: bfloat16 runs
// the AVX512-BF16 kernel where the CPU and the shape have one (false: the generic kernel, for tests).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     bool bf16_dot) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(float_or_bf16(q), "paged_decode_attention (cpu): float32 or bfloat16 only");
  check_caches(k_cache, v_cache, dtype, "paged_decode_attention");
  TORCH_CHECK(q.size(2) % 8 == 0, "paged_decode_attention (cpu): head_dim must be a multiple of 8");
  if (!dense_heads(q)) q = q.contiguous();  // any token stride is fine
  block_tables = block_tables.to(torch::kInt).contiguous();
  seq_lens = seq_lens.to(torch::kInt).contiguous();
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (bf16_dot && try_bf16_dot(q, k_cache, v_cache, block_tables, seq_lens, scale, out)) return out;
  by_dtype(q, [&](auto zero) {
    decode_attention<decltype(zero)>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}

// key/value [T, Hkv, D]; caches as above; slot_mapping [T] int64, -1 = skip. Semantics of
// kernels.kv_write.write_kv_slots_ref; float32 or bfloat16, caches of the keys' dtype.
void write_kv_slots(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(float_or_bf16(key) && value.scalar_type() == key.scalar_type(),
              "write_kv_slots (cpu): float32 or bfloat16 keys and values of one dtype");
  check_caches(k_cache, v_cache, key.scalar_type(), "write_kv_slots");
  // tokens may sit at any stride (views into the fused qkv output); each token's [Hkv, D] is dense
  if (!dense_heads(key)) key = key.contiguous();
  if (!dense_heads(value)) value = value.contiguous();
  slot_mapping = slot_mapping.to(torch::kLong).contiguous();
  const int64_t tokens = key.size(0), row = key.size(1) * key.size(2), block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  by_dtype(key, [&](auto zero) {
    using T = decltype(zero);
    const T* kp = key.data_ptr<T>();
    const T* vp = value.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      std::copy_n(kp + t * key.stride(0), row, kc + block * k_cache.stride(0) + offset * k_cache.stride(1));
      std::copy_n(vp + t * value.stride(0), row, vc + block * v_cache.stride(0) + offset * v_cache.stride(1));
    }
  });
}

namespace {

// rows x dense [rows, n] checks shared by the elementwise kernels
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(float_or_bf16(t) && t.dim() == 2 && t.stride(1) == 1, name,
              " (cpu): float32 or bfloat16 [rows, n] with dense rows");
}

void check_weight(const torch::Tensor& weight, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              name, " (cpu): a dense weight of the input's width and dtype");
}

// Rows of `width` floats per parallel task: a decode batch's few rows run on the calling thread,
// where waking the pool would cost more than the work.
inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 16) / width); }

// weight * (x / sqrt(mean(x^2) + eps)) for one row, into out; the sum in float32, and for bfloat16
// the normalized row rounded before the weight multiplies it (Hugging Face's RMSNorm)
template <typename T>
inline void rms_row(const T* x, const T* weight, int64_t n, double eps, T* out) {
  v8 acc = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) acc += load8(x + d) * load8(x + d);
  float sum = hsum8(acc);
  for (; d < n; ++d) sum += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
  for (d = 0; d + 8 <= n; d += 8) store8(out + d, load8(weight + d) * rounded<T>(load8(x + d) * inv));
  for (; d < n; ++d)
    out[d] = static_cast<T>(static_cast<float>(weight[d]) * rounded<T>(static_cast<float>(x[d]) * inv));
}

}  // namespace

// (rms_norm(x + residual) * weight, x + residual), both new [T, H] tensors
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && residual.scalar_type() == x.scalar_type());
  check_weight(weight, x, "add_rms_norm");
  auto summed = torch::empty({x.size(0), x.size(1)}, x.options());
  auto normed = torch::empty_like(summed);
  const int64_t rows = x.size(0), n = x.size(1);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    const T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T *sp = summed.data_ptr<T>(), *np = normed.data_ptr<T>();
    at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* srow = sp + r * n;
        const T *xrow = xp + r * x.stride(0), *rrow = rp + r * residual.stride(0);
        int64_t d = 0;
        for (; d + 8 <= n; d += 8) store8(srow + d, load8(rrow + d) + load8(xrow + d));
        for (; d < n; ++d) srow[d] = static_cast<T>(static_cast<float>(rrow[d]) + static_cast<float>(xrow[d]));
        rms_row(srow, wp, n, eps, np + r * n);
      }
    });
  });
  return {normed, summed};
}

// rms_norm(x) * weight as a new [T, H] tensor
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(weight, x, "rms_norm");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_row(xp + r * x.stride(0), wp, n, eps, op + r * n);
    });
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] (gate first), as a new [T, I] tensor; for bfloat16 silu's
// result is rounded before the product (torch's two ops)
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const v8 one = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  by_dtype(gate_up, [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *g = gp + r * gate_up.stride(0), *u = g + n;
        T* o = op + r * n;
        int64_t d = 0;
        for (; d + 8 <= n; d += 8) {
          const v8 gv = load8(g + d);
          store8(o + d, rounded<T>(gv / (one + exp8(-gv))) * load8(u + d));
        }
        for (; d < n; ++d) {
          const float gd = static_cast<float>(g[d]);
          o[d] = static_cast<T>(rounded<T>(gd / (1.f + std::exp(-gd))) * static_cast<float>(u[d]));
        }
      }
    });
  });
  return out;
}

// x * cos + rotate_half(x) * sin for x [T, H, D] with dense heads, cos/sin [T, D] of x's dtype; a
// new tensor. For bfloat16 each product is rounded, then their sum (torch's three ops).
torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(float_or_bf16(x) && x.dim() == 3 && dense_heads(x),
              "apply_rotary (cpu): float32 or bfloat16 [T, H, D] with dense heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2));
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "apply_rotary (cpu): cos and sin of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2, dim = x.size(2);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    const auto f = [](T v) { return static_cast<float>(v); };
    at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T *c = cp + t * dim, *s = sp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const T* in = xp + t * x.stride(0) + h * dim;
          T* o = op + (t * heads + h) * dim;
          int64_t i = 0;
          for (; i + 8 <= half; i += 8) {
            const v8 lo = load8(in + i), hi = load8(in + i + half);
            store8(o + i, rounded<T>(lo * load8(c + i)) + rounded<T>(-hi * load8(s + i)));
            store8(o + i + half, rounded<T>(hi * load8(c + i + half)) + rounded<T>(lo * load8(s + i + half)));
          }
          for (; i < half; ++i) {
            o[i] = static_cast<T>(rounded<T>(f(in[i]) * f(c[i])) + rounded<T>(-f(in[i + half]) * f(s[i])));
            o[i + half] =
                static_cast<T>(rounded<T>(f(in[i + half]) * f(c[i + half])) + rounded<T>(f(in[i]) * f(s[i + half])));
          }
        }
      }
    });
  });
  return out;
}

#ifndef SPLITSERVE_SOURCE_DIGEST
#define SPLITSERVE_SOURCE_DIGEST unknown
#endif
#define SPLITSERVE_STR2(x) #x
#define SPLITSERVE_STR(x) SPLITSERVE_STR2(x)

void register_gemm(pybind11::module_& m);                // cpu_gemm.cpp
void register_prefill_attention(pybind11::module_& m);  // cpu_prefill_attention.cpp
void register_threads(pybind11::module_& m);            // cpu_threads.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_digest") = SPLITSERVE_STR(SPLITSERVE_SOURCE_DIGEST);
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm, float32 or bfloat16, CPU");
  m.def("rms_norm", &rms_norm, "RMSNorm, float32 or bfloat16, CPU");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, float32 or bfloat16, CPU");
  m.def("apply_rotary", &apply_rotary, "rotary embedding, float32 or bfloat16, CPU");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention, float32 or bfloat16, CPU",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("bf16_dot") = true);
  m.def("has_bf16_dot", &cpu_has_bf16_dot, "whether bfloat16 attention and bf16_linear run on AVX512-BF16 here");
  m.def("write_kv_slots", &write_kv_slots, "store new keys/values at their slots, float32 or bfloat16, CPU");
  register_gemm(m);
  register_prefill_attention(m);
  register_threads(m);
}
