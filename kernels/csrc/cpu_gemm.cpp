// bfloat16 GEMM on CPUs with AVX512-BF16 (built into every library, chosen at run time by the caller
// through has_bf16_dot): y = x @ W.T + b with the weight packed once, at load, into 64-column tiles of
// VNNI pairs, so that every step of the inner loop is one 256-byte row of the tile (four registers of
// 16 columns x 2 depths) and one vdpbf16ps per register and row of x (32 products an instruction,
// summed in float32). Decode GEMMs of a few rows read the weight once, at the memory's speed; more
// rows are split into chunks of at most six that reuse each tile from L2.
//
// Layout (`pack_bf16_weight`): W [N, K] (N a multiple of 16, K even) is cut into tiles of 64 output
// columns (the last one 16, 32 or 48 wide when N is not a multiple of 64); a tile of width w holds
// [K/2][w][2]: for each depth pair i and column j, W[n0 + j, 2i] then W[n0 + j, 2i + 1]. The tiles
// follow each other, so tile t starts at t * 64 * K values. The packed tensor keeps W's shape [N, K]
// (its values reordered), and owns its memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "lanes.h"

bool cpu_has_bf16_dot();  // cpu_kernels.cpp

namespace {

constexpr int64_t TILE = 64;  // output columns of a packed tile: four registers of 16
constexpr int MAX_ROWS = 6;   // rows of x a pass carries: 6 x 4 accumulators + 4 weights + 1 broadcast

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
#include <immintrin.h>

namespace {

// y[r, 16t:16t+16] = bf16(sum over pairs i of x[r, 2i:2i+2] . b[i, t] (+ bias)) for r < MR, t < NT:
// MR rows of x (row stride ldx) against one tile NT registers wide (b: its first row; ldb values a row)
template <int MR, int NT>
void tile_rows(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t pairs, const float* bias, uint16_t* y,
               int64_t ldy) {
  constexpr int64_t ldb = NT * 32;
  __m512 acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_loadu_si512(b + i * ldb + t * 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = broadcast_pair(x + r * ldx + 2 * i);  // x[r, 2i] and x[r, 2i + 1]
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, w[t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m512 v = bias ? _mm512_add_ps(acc[r][t], _mm512_loadu_ps(bias + 16 * t)) : acc[r][t];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16 * t), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

using TileRows = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t);

template <int MR>
TileRows tile_rows_of_width(int64_t registers) {
  switch (registers) {
    case 4: return tile_rows<MR, 4>;
    case 3: return tile_rows<MR, 3>;
    case 2: return tile_rows<MR, 2>;
    default: return tile_rows<MR, 1>;
  }
}

TileRows tile_rows_for(int64_t rows, int64_t registers) {
  switch (rows) {
    case 1: return tile_rows_of_width<1>(registers);
    case 2: return tile_rows_of_width<2>(registers);
    case 3: return tile_rows_of_width<3>(registers);
    case 4: return tile_rows_of_width<4>(registers);
    case 5: return tile_rows_of_width<5>(registers);
    default: return tile_rows_of_width<6>(registers);
  }
}

}  // namespace
#pragma GCC pop_options

// W [N, K] bfloat16 -> the same values in the tiled layout above, shape [N, K]
torch::Tensor pack_bf16_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.device().is_cpu(),
              "pack_bf16_weight: a bfloat16 [N, K] CPU tensor");
  const int64_t n = w.size(0), k = w.size(1), full = n / TILE * TILE;
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0, "pack_bf16_weight: N must be a multiple of 16 and K even, got ", n,
              " x ", k);
  auto tiles = w.narrow(0, 0, full).reshape({full / TILE, TILE, k / 2, 2}).permute({0, 2, 1, 3}).reshape({-1});
  if (full < n) {
    auto tail = w.narrow(0, full, n - full).reshape({n - full, k / 2, 2}).permute({1, 0, 2}).reshape({-1});
    tiles = torch::cat({tiles, tail});
  }
  return tiles.contiguous().view({n, k});  // a fresh buffer even where N < 64 (the reshape of a permute copies)
}

// x [M, K] bfloat16 (rows dense); packed from pack_bf16_weight; bias [N] or None. Returns y [M, N]
// bfloat16: float32 sums of the exact products, bias added, rounded to nearest even.
torch::Tensor bf16_linear(torch::Tensor x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(cpu_has_bf16_dot(), "bf16_linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && packed.scalar_type() == torch::kBFloat16 &&
                  packed.dim() == 2 && packed.is_contiguous() && x.size(1) == packed.size(1),
              "bf16_linear: x [M, K] and a packed [N, K] weight, bfloat16");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t m = x.size(0), n = packed.size(0), k = packed.size(1), ldx = x.stride(0);
  auto y = torch::empty({m, n}, x.options());
  torch::Tensor bias32;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "bf16_linear: bias of ", n, " values, got ", bias->numel());
    bias32 = bias->to(torch::kFloat).contiguous();
  }
  const float* bp = bias ? bias32.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, (n + TILE - 1) / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * TILE, registers = std::min(TILE, n - n0) / 16;
      // full passes first (8 rows run as 6 + 2): only the first pass's arithmetic hides under the
      // weight stream from memory, the later ones read the tile from L2
      for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, m - r0);
        tile_rows_for(rows, registers)(xp + r0 * ldx, ldx, wp + n0 * k, k / 2, bp ? bp + n0 : nullptr,
                                       yp + r0 * n + n0, n);
      }
    }
  });
  return y;
}

void register_gemm(pybind11::module_& m) {
  m.def("pack_bf16_weight", &pack_bf16_weight, "bfloat16 [N, K] weight in bf16_linear's tiled layout, CPU");
  m.def("bf16_linear", &bf16_linear, "x @ W.T + b for a packed bfloat16 weight (AVX512-BF16 CPUs)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
}
