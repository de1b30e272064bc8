// Slot copies across every layer of a paged KV pool in one call: `pages_gather` reads a row's
// slots out of every layer, `pages_move` packs a row's kept slots (the same ones in every layer and
// head, or each (layer, head) its own) towards the front of the row in place.
//
// Why a kernel of our own: the pool is one tensor per layer (`kv_pages.Pages`), so in torch a read of
// a row's slots over every layer is one indexing per layer and a per-head compaction four per layer,
// keys and values: about 300 small operations per eviction of one row, 18 ms of SkipKV's eviction
// on 2 cores against well under a millisecond of bytes to copy. Here one call does them all.
//
// Layout: every pool `[N, H, BS, D]`, contiguous, all of one dtype; a slot is (page, offset), given
// as int64 `page`/`off` `[S]`, one entry per slot of the row. Bytes are copied as they are (any dtype).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

struct Geometry {
  int64_t pages, heads, block, dim, bytes;  // pages: the fewest any pool holds; bytes: one slot of one head
};

Geometry check_pools(const at::TensorList pools, const char* op) {
  TORCH_CHECK(!pools.empty(), op, ": no pools");
  const at::Tensor& first = pools[0];
  TORCH_CHECK(first.dim() == 4, op, ": each pool must be [N, H, BS, D], got ", first.sizes());
  int64_t pages = first.size(0);
  for (const at::Tensor& p : pools) {
    pages = std::min(pages, p.size(0));
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), op, ": pools must be contiguous CPU tensors");
    TORCH_CHECK(p.scalar_type() == first.scalar_type() && p.sizes().slice(1) == first.sizes().slice(1), op,
                ": every pool must share the first one's dtype and [H, BS, D]");
  }
  return {pages, first.size(1), first.size(2), first.size(3),
          first.size(3) * static_cast<int64_t>(first.element_size())};
}

// `t` as contiguous int64 [S], every entry in [0, bound): a page outside the pool or an offset
// outside a page would read or write another tensor's memory
at::Tensor slots_of(const at::Tensor& t, int64_t bound, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu(), op, ": ", name,
              " must be int64 [S] on the CPU");
  at::Tensor out = t.contiguous();
  const int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < out.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < bound, op, ": ", name, "[", i, "] = ", p[i], " is outside 0..", bound - 1);
  return out;
}

inline char* slot_ptr(const at::Tensor& pool, const Geometry& g, int64_t page, int64_t off, int64_t head) {
  return static_cast<char*>(pool.data_ptr()) + ((page * g.heads + head) * g.block + off) * g.bytes;
}

// out [L, H, S, D]: slot s of every layer and head
at::Tensor pages_gather(const at::TensorList pools, const at::Tensor& page_in, const at::Tensor& off_in) {
  const Geometry g = check_pools(pools, "pages_gather");
  const at::Tensor page = slots_of(page_in, g.pages, "pages_gather", "page");
  const at::Tensor off = slots_of(off_in, g.block, "pages_gather", "off");
  TORCH_CHECK(page.numel() == off.numel(), "pages_gather: page and off differ in length");
  const int64_t layers = static_cast<int64_t>(pools.size()), n = page.numel();
  at::Tensor out = at::empty({layers, g.heads, n, g.dim}, pools[0].options());
  const int64_t* pg = page.data_ptr<int64_t>();
  const int64_t* of = off.data_ptr<int64_t>();
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, layers * g.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t lh = begin; lh < end; ++lh) {
      const int64_t l = lh / g.heads, h = lh % g.heads;
      char* row = dst + lh * n * g.bytes;
      for (int64_t s = 0; s < n; ++s) std::memcpy(row + s * g.bytes, slot_ptr(pools[l], g, pg[s], of[s], h), g.bytes);
    }
  });
  return out;
}

// For every layer l and head h, the row's slots index[(l, h,) j] (positions in `page`/`off`) go to
// the slots at dst_page[j]/dst_off[j]: read first, then written, so sources and destinations may
// overlap. `index` is [K] (every layer and head alike) or [L, H, K].
void pages_move(const at::TensorList pools, const at::Tensor& page_in, const at::Tensor& off_in,
                const at::Tensor& index_in, const at::Tensor& dst_page_in, const at::Tensor& dst_off_in) {
  const Geometry g = check_pools(pools, "pages_move");
  const at::Tensor page = slots_of(page_in, g.pages, "pages_move", "page");
  const at::Tensor off = slots_of(off_in, g.block, "pages_move", "off");
  const at::Tensor dst_page = slots_of(dst_page_in, g.pages, "pages_move", "dst_page");
  const at::Tensor dst_off = slots_of(dst_off_in, g.block, "pages_move", "dst_off");
  const int64_t layers = static_cast<int64_t>(pools.size()), span = page.numel(), k = dst_page.numel();
  TORCH_CHECK(off.numel() == span && dst_off.numel() == k, "pages_move: page/off or dst_page/dst_off differ in length");
  TORCH_CHECK(index_in.scalar_type() == at::kLong, "pages_move: index must be int64");
  const bool per_head = index_in.dim() == 3;
  TORCH_CHECK(
      (index_in.dim() == 1 && index_in.size(0) == k) ||
          (per_head && index_in.size(0) == layers && index_in.size(1) == g.heads && index_in.size(2) == k),
      "pages_move: index must be [K] or [L, H, K] with K = len(dst_page), got ", index_in.sizes());
  const at::Tensor index = index_in.contiguous();
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < span, "pages_move: index ", idx[i], " outside the row's ", span, " slots");
  const int64_t* pg = page.data_ptr<int64_t>();
  const int64_t* of = off.data_ptr<int64_t>();
  const int64_t* dpg = dst_page.data_ptr<int64_t>();
  const int64_t* dof = dst_off.data_ptr<int64_t>();
  at::parallel_for(0, layers * g.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> staged(static_cast<size_t>(k * g.bytes));
    for (int64_t lh = begin; lh < end; ++lh) {
      const int64_t l = lh / g.heads, h = lh % g.heads;
      const int64_t* mine = per_head ? idx + lh * k : idx;
      for (int64_t j = 0; j < k; ++j)
        std::memcpy(staged.data() + j * g.bytes, slot_ptr(pools[l], g, pg[mine[j]], of[mine[j]], h), g.bytes);
      for (int64_t j = 0; j < k; ++j)
        std::memcpy(slot_ptr(pools[l], g, dpg[j], dof[j], h), staged.data() + j * g.bytes, g.bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(branchwise, m) {
  m.def("pages_gather(Tensor[] pools, Tensor page, Tensor off) -> Tensor");
  m.def("pages_move(Tensor(a!)[] pools, Tensor page, Tensor off, Tensor index, Tensor dst_page, Tensor dst_off) -> ()");
}

TORCH_LIBRARY_IMPL(branchwise, CPU, m) {
  m.impl("pages_gather", &pages_gather);
  m.impl("pages_move", &pages_move);
}
