// Decode attention over a paged KV pool, read in place, returning the output and its log-sum-exp.
//
// Why a kernel of our own: a pool of fixed-size KV blocks (a block table per row) only pays on a
// CPU if attention reads each row's blocks where they lie. Gathering them into a padded copy
// first costs one copy of every KV byte per layer per step (2-5x the attention itself on 2 cores).
// The log-sum-exp comes back with the output because the cascade (a shared prefix read once for
// all rows, each row's own KV apart) merges partial attentions by it.
//
// Layout: k_pool / v_pool `[N_blocks, H_kv, BS, D]` (any strides on the first three dims, the
// last contiguous), so one (block, head) is one contiguous run of BS x D values; q `[B, Hq, D]`,
// Hq a multiple of H_kv (grouped-query attention: the G = Hq / H_kv query heads of a KV head read
// its keys once); block_table `[B, M]` int32, lens `[B]` int32 (a row's tokens are its first
// ceil(len / BS) blocks' first `len` slots). Out `[B, Hq, D]` in q's dtype, lse `[B, Hq]` float32
// (natural log of the sum of exp(scale * q.k)); a row of length 0 gives zeros and -inf.
// `paged_decode_mass` also returns the attention mass each own slot got, `[B, M * BS]` float32:
// exp(scale * q.k - lse of everything the query read) summed over the query heads, 0 past a row's
// length. What an attention-mass tap needs: the scores stay in the kernel's scratch and are
// exponentiated once the total log-sum-exp is known, where a tap scoring the keys itself would read
// every key a second time, and a tap handed the scores would exponentiate a `[B, Hq, M * BS]` grid
// in half a dozen operations of its own per layer.
//
// Shared segments: `seg_keys[i]` / `seg_values[i]` `[H_kv, T_i, D]` (contiguous head dim), read by
// the rows `seg_rows[i]` (int32; a negative entry names no row, and a segment no row reads is
// skipped: padding that keeps a compiled step's count of segments and readers at a few fixed sizes):
// a tree's ancestors, each read once for all the rows under it. The
// output is attention over each row's own blocks and every segment it reads, as one softmax: the
// cascade's merge done here rather than by a dozen small operations per segment per layer (on a
// CPU those, not the arithmetic, were 30 % of a beam search's step).
//
// Work: each (row, KV head)'s own blocks and each (segment, KV head)'s tokens are cut into chunks;
// chunks run on torch's threads, pulled costliest first from a shared counter (rows of unequal
// length balance themselves), each an online softmax over tiles of tokens in fp32 (a segment's
// chunk for all its rows' queries at once, its keys read once; a segment under many rows is one
// matrix product instead, `kProductFrom`); a row read in several parts (one long row on many
// cores: flash-decoding; a row under shared segments) has them merged by log-sum-exp at the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecLen = Vec::size();
constexpr int64_t kTileTokens = 64;  // tokens scored before one softmax update (whole blocks)
// How far ahead a tile's KV is requested: 1, 2, 4 and 8 tiles were within noise of each other on a
// shared 2-core machine (7-8 GB/s from one core, both layouts alike); 2 keeps ~64 KB in flight.
constexpr int64_t kPrefetchTiles = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// q . row for each of `n` rows, into s[0..n): q held in registers when the head size is known at
// compile time (kD > 0, a multiple of the vector width), else looped over d.
template <int kD>
inline void score_rows(const float* q, const float* const* rows, int64_t n, float* s, int64_t d) {
  if constexpr (kD > 0) {
    constexpr int64_t kV = kD / kVecLen;
    Vec qv[kV];
    for (int64_t i = 0; i < kV; ++i) qv[i] = Vec::loadu(q + i * kVecLen);
    for (int64_t t = 0; t < n; ++t) {
      const float* r = rows[t];
      Vec acc = qv[0] * Vec::loadu(r);
      for (int64_t i = 1; i < kV; ++i) acc = at::vec::fmadd(qv[i], Vec::loadu(r + i * kVecLen), acc);
      s[t] = acc.reduce_add();
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const float* r = rows[t];
      int64_t i = 0;
      Vec acc(0.f);
      for (; i + kVecLen <= d; i += kVecLen) acc = at::vec::fmadd(Vec::loadu(q + i), Vec::loadu(r + i), acc);
      float total = acc.reduce_add();
      for (; i < d; ++i) total += q[i] * r[i];
      s[t] = total;
    }
  }
}

// acc = acc * alpha + sum_t p[t] * rows[t], the accumulator held in registers when kD > 0.
template <int kD>
inline void accumulate_rows(float* acc, float alpha, const float* p, const float* const* rows, int64_t n,
                            int64_t d) {
  if constexpr (kD > 0) {
    constexpr int64_t kV = kD / kVecLen;
    Vec a[kV];
    const Vec av(alpha);
    for (int64_t i = 0; i < kV; ++i) a[i] = Vec::loadu(acc + i * kVecLen) * av;
    for (int64_t t = 0; t < n; ++t) {
      const Vec w(p[t]);
      const float* r = rows[t];
      for (int64_t i = 0; i < kV; ++i) a[i] = at::vec::fmadd(w, Vec::loadu(r + i * kVecLen), a[i]);
    }
    for (int64_t i = 0; i < kV; ++i) a[i].store(acc + i * kVecLen);
  } else {
    for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
    for (int64_t t = 0; t < n; ++t) {
      const Vec w(p[t]);
      const float* r = rows[t];
      int64_t i = 0;
      for (; i + kVecLen <= d; i += kVecLen) at::vec::fmadd(w, Vec::loadu(r + i), Vec::loadu(acc + i)).store(acc + i);
      for (; i < d; ++i) acc[i] += p[t] * r[i];
    }
  }
}

inline void axpy(float* acc, float w, const float* x, int64_t d) {
  const Vec wv(w);
  int64_t i = 0;
  for (; i + kVecLen <= d; i += kVecLen) at::vec::fmadd(wv, Vec::loadu(x + i), Vec::loadu(acc + i)).store(acc + i);
  for (; i < d; ++i) acc[i] += w * x[i];
}

template <typename scalar_t>
inline void store(scalar_t* dst, const float* src, float w, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(src[i] * w);
}

// Pointers to the tile's `n` token rows (blocks [t0, t1) of the row's table) as floats: into the
// pool itself for fp32, else converted into `scratch` (kTileTokens x D floats).
template <typename scalar_t>
inline int64_t tile_rows(const scalar_t* pool, const int32_t* blocks, int64_t t0, int64_t t1, int64_t len,
                         int64_t BS, int64_t sN, int64_t sH, int64_t sT, int64_t head, int64_t D,
                         float* scratch, const float** rows) {
  int64_t n = 0;
  for (int64_t j = t0; j < t1; ++j) {
    const int64_t valid = std::min(BS, len - j * BS);
    const scalar_t* base = pool + blocks[j] * sN + head * sH;
    for (int64_t t = 0; t < valid; ++t, ++n) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        rows[n] = base + t * sT;
      } else {
        at::vec::convert(base + t * sT, scratch + n * D, D);
        rows[n] = scratch + n * D;
      }
    }
  }
  return n;
}

inline int64_t tile_blocks_of(int64_t BS) { return std::max<int64_t>(1, kTileTokens / BS); }

// Ask for the KV of blocks [j0, j1) ahead of their reading: a row's blocks lie anywhere in the
// pool, so the hardware prefetcher, which follows one address stream within a page, restarts at
// every block; issuing the next tile's lines while this one is computed hides that.
template <typename scalar_t>
inline void prefetch_blocks(const scalar_t* k_pool, const scalar_t* v_pool, const int32_t* blocks, int64_t j0,
                            int64_t j1, int64_t len, int64_t BS, int64_t sN, int64_t sH, int64_t sT,
                            int64_t head, int64_t D) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // values per cache line
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t valid = std::min(BS, len - j * BS);
    const int64_t offset = blocks[j] * sN + head * sH;
    if (sT == D) {  // the (block, head) is one contiguous run
      for (int64_t i = 0; i < valid * D; i += kLine) {
        __builtin_prefetch(k_pool + offset + i, 0, 3);
        __builtin_prefetch(v_pool + offset + i, 0, 3);
      }
    } else {
      for (int64_t t = 0; t < valid; ++t) {
        for (int64_t i = 0; i < D; i += kLine) {
          __builtin_prefetch(k_pool + offset + t * sT + i, 0, 3);
          __builtin_prefetch(v_pool + offset + t * sT + i, 0, 3);
        }
      }
    }
  }
}

inline int64_t tile_tokens_of(int64_t BS) { return tile_blocks_of(BS) * BS; }

// floats of one worker's scratch for chunks of up to `nq` queries (`paged_decode_impl`'s `ws`)
inline int64_t workspace_floats(int64_t nq, int64_t D, int64_t BS) {
  return nq * D * 2 + nq * tile_tokens_of(BS) + 2 * tile_tokens_of(BS) * D + 2 * nq;
}

// A shared segment: keys and values `[H_kv, T, D]` (any strides but the last), read by `rows`.
template <typename scalar_t>
struct Segment {
  at::Tensor keys, values;
  const scalar_t* k;
  const scalar_t* v;
  int64_t tokens, ksH, ksT, vsH, vsT;
  std::vector<int64_t> rows;
};

// A segment read by this many queries a KV head or more (rows x query heads a KV head) is read by
// one matrix product for all of them (PyTorch's flash kernel, which returns the log-sum-exp too),
// not by tiles of this kernel: its per-query dot products lost to the product from there on
// (2 AVX2 cores, 9 query heads on 3 KV heads: even at 8 rows under a 1,024-token segment, 45 %
// slower at 64), where for a few rows one call beat a product and a merge per segment.
constexpr int64_t kProductFrom = 32;

// A segment read by a product: its partial results go to slots [slot, slot + H * rows), head-major.
struct Product {
  int64_t seg, slot;
};

// The tiles of a row's own blocks [first, last) of its table, for one KV head.
template <typename scalar_t>
struct BlockTiles {
  const scalar_t *k_pool, *v_pool;
  const int32_t* blocks;
  int64_t first, last, len, BS, sN, sH, sT, head, D;
  int64_t step = tile_blocks_of(BS);

  int64_t count() const { return (last - first + step - 1) / step; }
  int64_t first_slot(int64_t i) const { return (first + i * step) * BS; }
  void prefetch(int64_t i, int64_t tiles) const {  // tiles [i, i + tiles)
    const int64_t j0 = std::min(last, first + i * step), j1 = std::min(last, first + (i + tiles) * step);
    prefetch_blocks(k_pool, v_pool, blocks, j0, j1, len, BS, sN, sH, sT, head, D);
  }
  int64_t fill(int64_t i, float* kbuf, float* vbuf, const float** krows, const float** vrows) const {
    prefetch(i + kPrefetchTiles, 1);  // the tile `kPrefetchTiles` ahead requested now
    const int64_t t0 = first + i * step, t1 = std::min(last, t0 + step);
    const int64_t n = tile_rows(k_pool, blocks, t0, t1, len, BS, sN, sH, sT, head, D, kbuf, krows);
    tile_rows(v_pool, blocks, t0, t1, len, BS, sN, sH, sT, head, D, vbuf, vrows);
    return n;
  }
};

// The tiles of a shared segment's tokens [first, last), for one KV head: consecutive rows, which
// the hardware prefetcher follows by itself.
template <typename scalar_t>
struct SegmentTiles {
  const scalar_t *k, *v;  // at the head
  int64_t first, last, ksT, vsT, D, step;

  int64_t count() const { return (last - first + step - 1) / step; }
  void prefetch(int64_t, int64_t) const {}
  int64_t fill(int64_t i, float* kbuf, float* vbuf, const float** krows, const float** vrows) const {
    const int64_t t0 = first + i * step, n = std::min(step, last - t0);
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        krows[t] = k + (t0 + t) * ksT;
        vrows[t] = v + (t0 + t) * vsT;
      } else {
        at::vec::convert(k + (t0 + t) * ksT, kbuf + t * D, D);
        at::vec::convert(v + (t0 + t) * vsT, vbuf + t * D, D);
        krows[t] = kbuf + t * D;
        vrows[t] = vbuf + t * D;
      }
    }
    return n;
  }
};

// One chunk's online softmax of `nq` queries (`qf`, scaled, nq x D floats) over `tiles`: leaves
// the unnormalised output in `acc` (nq x D), the running max in `m` and the sum in `l` (nq each).
// Each tile's K rows are scored for all the queries (the keys read once from memory, then from
// L1), then its V rows accumulated likewise. `scored`, where given (a row's own blocks), takes
// every score at the row's slot (`tiles.first_slot`), query g's at `scored + g * S`.
template <int kD, typename Tiles>
void online_softmax(const Tiles& tiles, const float* qf, int64_t nq, int64_t D, int64_t tile_cap,
                    float* acc, float* m, float* l, float* scores, float* kbuf, float* vbuf,
                    const float** krows, const float** vrows, float* scored, int64_t S) {
  for (int64_t g = 0; g < nq; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  std::fill(acc, acc + nq * D, 0.f);
  const int64_t n_tiles = tiles.count();
  tiles.prefetch(0, kPrefetchTiles);  // the first tiles' KV requested before any is read
  for (int64_t i = 0; i < n_tiles; ++i) {
    const int64_t n = tiles.fill(i, kbuf, vbuf, krows, vrows);
    for (int64_t g = 0; g < nq; ++g) {
      float* s = scores + g * tile_cap;
      score_rows<kD>(qf + g * D, krows, n, s, D);
      if constexpr (std::is_same_v<Tiles, BlockTiles<float>> || std::is_same_v<Tiles, BlockTiles<at::BFloat16>>) {
        if (scored != nullptr) std::copy(s, s + n, scored + g * S + tiles.first_slot(i));
      }
      // the softmax update: new max, what came before rescaled, the tile exponentiated
      const float tile_max =
          at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, n);
      const float m_new = std::max(m[g], tile_max);
      const float alpha = m[g] == kNegInf ? 0.f : std::exp(m[g] - m_new);
      at::vec::map([m_new](Vec x) { return (x - Vec(m_new)).exp_u20(); }, s, s, n);
      l[g] = l[g] * alpha + at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, n);
      m[g] = m_new;
      accumulate_rows<kD>(acc + g * D, alpha, s, vrows, n, D);
    }
  }
}

struct Chunk {
  int64_t seg;              // -1: a row's own blocks [first, last); else shared segment `seg`'s tokens
  int64_t row, head;        // (a segment's chunk reads for every row of the segment)
  int64_t first, last;
  int64_t slot;             // where its partial results go, one per row (-1: final, a whole own row)
  int64_t cost;             // queries x tokens: the longest first
};

// Rows read in parts (split into chunks, or a shared segment besides their own blocks): each (row,
// head)'s partial results `part_o` / `part_l` merged by log-sum-exp into `out` and `lse`.
template <typename scalar_t>
void merge_parts(const std::vector<Chunk>& chunks, const std::vector<Product>& products,
                 const std::vector<Segment<scalar_t>>& segments, const at::Tensor& part_o, const at::Tensor& part_l,
                 int64_t B, int64_t H, int64_t G, int64_t D, scalar_t* out_p, float* lse_p) {
  const float* po = part_o.data_ptr<float>();
  const float* pl = part_l.data_ptr<float>();
  const int64_t Hq = H * G;
  std::vector<std::vector<int64_t>> parts(B * H);
  for (const Product& p : products) {
    const auto& rows = segments[p.seg].rows;
    const int64_t r = static_cast<int64_t>(rows.size());
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < r; ++j) parts[rows[j] * H + h].push_back(p.slot + h * r + j);
    }
  }
  for (const Chunk& c : chunks) {
    if (c.slot < 0) continue;
    if (c.seg < 0) {
      parts[c.row * H + c.head].push_back(c.slot);
    } else {
      const auto& rows = segments[c.seg].rows;
      for (int64_t j = 0; j < static_cast<int64_t>(rows.size()); ++j) parts[rows[j] * H + c.head].push_back(c.slot + j);
    }
  }
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t key = begin; key < end; ++key) {
      const auto& mine = parts[key];
      if (mine.empty()) continue;
      const int64_t b = key / H, h = key % H;
      for (int64_t g = 0; g < G; ++g) {
        float top = kNegInf;
        for (int64_t slot : mine) top = std::max(top, pl[slot * G + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        if (top != kNegInf) {
          for (int64_t slot : mine) {
            const float w = std::exp(pl[slot * G + g] - top);
            sum += w;
            axpy(acc.data(), w, po + (slot * G + g) * D, D);
          }
        }
        const int64_t qh = h * G + g;
        store(out_p + b * Hq * D + qh * D, acc.data(), sum > 0.f ? 1.f / sum : 0.f, D);
        lse_p[b * Hq + qh] = sum > 0.f ? top + std::log(sum) : kNegInf;
      }
    }
  });
}

// Each own slot's attention mass, summed over the query heads: exp(score - lse) against the
// log-sum-exp of everything the query read, into `mass` `[B, S]` (zero past a row's length).
inline void add_mass(const float* scores, const float* lse, const int32_t* len_of, int64_t B, int64_t Hq,
                     int64_t S, float* mass) {
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(S);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = len_of[b];
      float* dst = mass + b * S;
      std::fill(dst, dst + S, 0.f);
      for (int64_t qh = 0; qh < Hq; ++qh) {
        const float top = lse[b * Hq + qh];
        if (top == kNegInf || n == 0) continue;
        const float* src = scores + (b * Hq + qh) * S;
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, e.data(), src, n);
        at::vec::map2([](Vec a, Vec x) { return a + x; }, dst, dst, e.data(), n);
      }
    }
  });
}

template <typename scalar_t>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& block_table, const at::Tensor& lens,
                       const std::vector<Segment<scalar_t>>& segments, double scale, int64_t chunk_blocks,
                       at::Tensor& out, at::Tensor& lse, float* scores_p, float* mass_p) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t H = k_pool.size(1), BS = k_pool.size(2);
  const int64_t G = Hq / H;
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const int32_t* len_of = lens.data_ptr<int32_t>();

  // the chunks: each (row, head)'s own blocks and each (segment, head)'s tokens cut into runs of
  // `chunk_blocks` blocks
  std::vector<int64_t> row_blocks(B);
  std::vector<bool> reads_segment(B, false);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    row_blocks[b] = (len_of[b] + BS - 1) / BS;
    total += row_blocks[b] * H;
  }
  int64_t most_queries = G;
  for (const auto& seg : segments) {
    const int64_t queries = static_cast<int64_t>(seg.rows.size()) * G;
    if (queries < kProductFrom) {
      total += (seg.tokens + BS - 1) / BS * H;
      most_queries = std::max<int64_t>(most_queries, queries);
    }
    for (int64_t b : seg.rows) reads_segment[b] = true;
  }
  const int64_t threads = at::get_num_threads();
  if (chunk_blocks <= 0) {
    // enough chunks to keep every thread busy to the end (8 per thread), none under 4 blocks
    chunk_blocks = std::max<int64_t>(4, (total + 8 * threads - 1) / (8 * threads));
  }
  std::vector<Chunk> chunks;
  int64_t slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = row_blocks[b];
    const int64_t splits = std::max<int64_t>(1, (nb + chunk_blocks - 1) / chunk_blocks);
    const bool partial = splits > 1 || reads_segment[b];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t first = s * chunk_blocks, last = std::min(nb, first + chunk_blocks);
        chunks.push_back({-1, b, h, first, last, partial ? slots++ : -1, G * (last - first) * BS});
      }
    }
  }
  const int64_t chunk_tokens = chunk_blocks * BS;
  std::vector<Product> products;
  for (int64_t i = 0; i < static_cast<int64_t>(segments.size()); ++i) {
    const auto& seg = segments[i];
    const int64_t r = static_cast<int64_t>(seg.rows.size());
    if (r == 0) continue;
    if (r * G >= kProductFrom) {
      products.push_back({i, slots});
      slots += H * r;
      continue;
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t first = 0; first < seg.tokens; first += chunk_tokens) {
        const int64_t last = std::min(seg.tokens, first + chunk_tokens);
        chunks.push_back({i, -1, h, first, last, slots, r * G * (last - first)});
        slots += r;
      }
    }
  }
  std::stable_sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.cost > b.cost; });
  at::Tensor part_o = at::empty({std::max<int64_t>(slots, 1), G, D}, q.options().dtype(at::kFloat));
  at::Tensor part_l = at::empty({std::max<int64_t>(slots, 1), G}, q.options().dtype(at::kFloat));
  float* po = part_o.data_ptr<float>();
  float* pl = part_l.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  scalar_t* out_p = out.data_ptr<scalar_t>();
  const scalar_t* q_p = q.data_ptr<scalar_t>();
  const scalar_t* k_p = k_pool.data_ptr<scalar_t>();
  const scalar_t* v_p = v_pool.data_ptr<scalar_t>();
  const int64_t sN = k_pool.stride(0), sH = k_pool.stride(1), sT = k_pool.stride(2);
  TORCH_CHECK(v_pool.stride(0) == sN && v_pool.stride(1) == sH && v_pool.stride(2) == sT,
              "paged_decode: k_pool and v_pool must have the same strides");
  const float fscale = static_cast<float>(scale);
  const int64_t S = block_table.size(1) * BS;  // slots per row in `scores_p`
  const int64_t tile_cap = tile_tokens_of(BS);

  // the head size as a compile-time constant where it is a common one (the loops then keep q and
  // the accumulator in registers)
  auto own = &online_softmax<0, BlockTiles<scalar_t>>;
  auto shared = &online_softmax<0, SegmentTiles<scalar_t>>;
  if (D == 64 && D % kVecLen == 0) {
    own = &online_softmax<64, BlockTiles<scalar_t>>;
    shared = &online_softmax<64, SegmentTiles<scalar_t>>;
  }
  if (D == 128 && D % kVecLen == 0) {
    own = &online_softmax<128, BlockTiles<scalar_t>>;
    shared = &online_softmax<128, SegmentTiles<scalar_t>>;
  }

  // segments read by many rows: one product each for all their queries, into their slots
  for (const Product& p : products) {
    const auto& seg = segments[p.seg];
    const int64_t r = static_cast<int64_t>(seg.rows.size());
    const at::Tensor rows = at::tensor(seg.rows, q.options().dtype(at::kLong));
    const at::Tensor queries = q.index_select(0, rows).view({r, H, G, D}).transpose(0, 1).reshape({1, H, r * G, D});
    auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(
        queries, seg.keys.unsqueeze(0), seg.values.unsqueeze(0), 0.0, false, std::nullopt, scale);
    part_o.narrow(0, p.slot, H * r).copy_(o.reshape({H * r, G, D}));
    part_l.narrow(0, p.slot, H * r).copy_(l.reshape({H * r, G}));
  }

  std::atomic<int64_t> next{0};
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  at::parallel_for(0, std::min(threads, n_chunks), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ws(workspace_floats(most_queries, D, BS));
    std::vector<const float*> ptrs(2 * tile_cap);
    const int64_t nq_max = most_queries;
    float* qf = ws.data();                // queries x D, scaled
    float* acc = qf + nq_max * D;          // queries x D
    float* sc = acc + nq_max * D;          // queries x tile_cap
    float* kbuf = sc + nq_max * tile_cap;  // tile_cap x D (bf16 -> fp32)
    float* vbuf = kbuf + tile_cap * D;     // tile_cap x D
    float* m = vbuf + tile_cap * D;        // running maxima
    float* l = m + nq_max;                 // running sums
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < n_chunks; i = next.fetch_add(1)) {
        const Chunk& c = chunks[i];
        const int64_t* rows = c.seg < 0 ? &c.row : segments[c.seg].rows.data();
        const int64_t r = c.seg < 0 ? 1 : static_cast<int64_t>(segments[c.seg].rows.size());
        for (int64_t j = 0; j < r; ++j) {
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* qg = q_p + rows[j] * q.stride(0) + (c.head * G + g) * D;
            for (int64_t e = 0; e < D; ++e) qf[(j * G + g) * D + e] = static_cast<float>(qg[e]) * fscale;
          }
        }
        if (c.seg < 0) {
          const BlockTiles<scalar_t> tiles{k_p, v_p, table + c.row * table_stride, c.first, c.last,
                                           len_of[c.row], BS, sN, sH, sT, c.head, D};
          float* scored = scores_p == nullptr ? nullptr : scores_p + (c.row * Hq + c.head * G) * S;
          own(tiles, qf, G, D, tile_cap, acc, m, l, sc, kbuf, vbuf, ptrs.data(), ptrs.data() + tile_cap, scored, S);
        } else {
          const auto& seg = segments[c.seg];
          const SegmentTiles<scalar_t> tiles{seg.k + c.head * seg.ksH, seg.v + c.head * seg.vsH, c.first, c.last,
                                             seg.ksT, seg.vsT, D, tile_cap};
          shared(tiles, qf, r * G, D, tile_cap, acc, m, l, sc, kbuf, vbuf, ptrs.data(), ptrs.data() + tile_cap,
                 nullptr, S);
        }
        // each query's normalised output and log-sum-exp: final for a whole own row, else a part
        for (int64_t j = 0; j < r; ++j) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t k = j * G + g;
            const float inv = l[k] > 0.f ? 1.f / l[k] : 0.f;
            const float total = l[k] > 0.f ? m[k] + std::log(l[k]) : kNegInf;
            if (c.slot < 0) {
              const int64_t qh = c.head * G + g;
              store(out_p + rows[j] * Hq * D + qh * D, acc + k * D, inv, D);
              lse_p[rows[j] * Hq + qh] = total;
            } else {
              float* dst = po + ((c.slot + j) * G + g) * D;
              for (int64_t e = 0; e < D; ++e) dst[e] = acc[k * D + e] * inv;
              pl[(c.slot + j) * G + g] = total;
            }
          }
        }
      }
    }
  });
  if (slots > 0) merge_parts(chunks, products, segments, part_o, part_l, B, H, G, D, out_p, lse_p);
  if (mass_p != nullptr) add_mass(scores_p, lse_p, len_of, B, Hq, S, mass_p);
}


// The shared segments as the kernel reads them, each checked against the pool's heads and dtype.
template <typename scalar_t>
std::vector<Segment<scalar_t>> segments_of(const at::TensorList seg_keys, const at::TensorList seg_values,
                                           const at::TensorList seg_rows, const at::Tensor& k_pool, int64_t B) {
  TORCH_CHECK(seg_keys.size() == seg_values.size() && seg_keys.size() == seg_rows.size(),
              "paged_decode: seg_keys, seg_values and seg_rows must have one entry per segment (got ",
              seg_keys.size(), ", ", seg_values.size(), ", ", seg_rows.size(), ")");
  const int64_t H = k_pool.size(1), D = k_pool.size(3);
  std::vector<Segment<scalar_t>> segments;
  for (size_t i = 0; i < seg_keys.size(); ++i) {
    const at::Tensor &k = seg_keys[i], &v = seg_values[i];
    TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == H && k.size(2) == D,
                "paged_decode: segment ", i, " keys and values must be [H_kv=", H, ", T, D=", D, "]");
    TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == k_pool.scalar_type(),
                "paged_decode: segment ", i, " must have the pool's dtype");
    TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "paged_decode: segment ", i, " head dim must be contiguous");
    const at::Tensor rows = seg_rows[i].contiguous();
    TORCH_CHECK(rows.scalar_type() == at::kInt && rows.dim() == 1, "paged_decode: seg_rows[", i, "] must be int32 [r]");
    Segment<scalar_t> seg{k, v, k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k.size(1), k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), {}};
    const int32_t* r = rows.data_ptr<int32_t>();
    for (int64_t j = 0; j < rows.numel(); ++j) {
      if (r[j] < 0) continue;  // padding (the header)
      TORCH_CHECK(r[j] < B, "paged_decode: seg_rows[", i, "] names row ", r[j], ", outside 0..", B - 1);
      seg.rows.push_back(r[j]);
    }
    if (seg.tokens > 0 && !seg.rows.empty()) segments.push_back(std::move(seg));
  }
  return segments;
}

// Checks the inputs, then runs the kernel; `mass`, where given, takes every own slot's attention mass.
std::tuple<at::Tensor, at::Tensor> run_checked(const at::Tensor& q_in, const at::Tensor& k_pool,
                                               const at::Tensor& v_pool, const at::Tensor& block_table,
                                               const at::Tensor& lens, const at::TensorList seg_keys,
                                               const at::TensorList seg_values, const at::TensorList seg_rows,
                                               double scale, int64_t chunk_blocks, at::Tensor* mass) {
  TORCH_CHECK(q_in.dim() == 3, "paged_decode: q must be [B, Hq, D]");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "paged_decode: pools must be [N, H_kv, BS, D]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "paged_decode: k_pool and v_pool differ in shape");
  TORCH_CHECK(q_in.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_decode: q, k_pool and v_pool must share a dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "paged_decode: float32 or bfloat16 only, got ", q_in.scalar_type());
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "paged_decode: head dim must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "paged_decode: block_table and lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1, "paged_decode: block_table [B, M], rows contiguous");
  const int64_t B = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t N = k_pool.size(0), H = k_pool.size(1), BS = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D, "paged_decode: head sizes differ (q ", D, ", pool ", k_pool.size(3), ")");
  TORCH_CHECK(H > 0 && Hq % H == 0, "paged_decode: query heads (", Hq, ") not a multiple of KV heads (", H, ")");
  TORCH_CHECK(block_table.size(0) == B && lens.numel() == B, "paged_decode: block_table and lens need B rows");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor lens_c = lens.contiguous();
  const int32_t* len_of = lens_c.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t M = block_table.size(1);
  for (int64_t b = 0; b < B; ++b) {  // every block a row reads lies in the pool
    TORCH_CHECK(len_of[b] >= 0 && len_of[b] <= M * BS, "paged_decode: row ", b, " length ", len_of[b],
                " outside 0..", M * BS);
    for (int64_t j = 0; j < (len_of[b] + BS - 1) / BS; ++j) {
      const int32_t blk = table[b * block_table.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < N, "paged_decode: row ", b, " block ", j, " is ", blk,
                  ", outside the pool of ", N);
    }
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  at::Tensor lse = at::empty({B, Hq}, q.options().dtype(at::kFloat));
  float* scores_p = nullptr;
  float* mass_p = nullptr;
  at::Tensor scores;
  if (mass != nullptr) {  // the scores are written as far as each row's length, and read by `add_mass`
    scores = at::empty({B, Hq, M * BS}, q.options().dtype(at::kFloat));
    scores_p = scores.data_ptr<float>();
    *mass = at::empty({B, M * BS}, q.options().dtype(at::kFloat));  // zeroed by `add_mass`
    mass_p = mass->data_ptr<float>();
  }
  if (q.scalar_type() == at::kFloat) {
    const auto segments = segments_of<float>(seg_keys, seg_values, seg_rows, k_pool, B);
    if (B > 0) {
      paged_decode_impl<float>(q, k_pool, v_pool, block_table, lens_c, segments, scale, chunk_blocks, out, lse,
                               scores_p, mass_p);
    }
  } else {
    const auto segments = segments_of<at::BFloat16>(seg_keys, seg_values, seg_rows, k_pool, B);
    if (B > 0) {
      paged_decode_impl<at::BFloat16>(q, k_pool, v_pool, block_table, lens_c, segments, scale, chunk_blocks, out,
                                      lse, scores_p, mass_p);
    }
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                                const at::Tensor& v_pool, const at::Tensor& block_table,
                                                const at::Tensor& lens, const at::TensorList seg_keys,
                                                const at::TensorList seg_values, const at::TensorList seg_rows,
                                                double scale, int64_t chunk_blocks) {
  return run_checked(q, k_pool, v_pool, block_table, lens, seg_keys, seg_values, seg_rows, scale, chunk_blocks,
                     nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode_mass(
    const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_table,
    const at::Tensor& lens, const at::TensorList seg_keys, const at::TensorList seg_values,
    const at::TensorList seg_rows, double scale, int64_t chunk_blocks) {
  at::Tensor mass;
  auto [out, lse] = run_checked(q, k_pool, v_pool, block_table, lens, seg_keys, seg_values, seg_rows, scale,
                                chunk_blocks, &mass);
  return {out, lse, mass};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(branchwise, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor lens, "
      "Tensor[] seg_keys, Tensor[] seg_values, Tensor[] seg_rows, float scale, int chunk_blocks=0) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "paged_decode_mass(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor lens, "
      "Tensor[] seg_keys, Tensor[] seg_values, Tensor[] seg_rows, float scale, int chunk_blocks=0) "
      "-> (Tensor out, Tensor lse, Tensor mass)");
}

TORCH_LIBRARY_IMPL(branchwise, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_mass", &paged_decode_mass);
}
