// A step's new keys and values into the paged CPU cache, in place, in one dispatch (attention.py's
// `_write_kv` in torch ops is the reference and the path for an int8 cache): the step's fresh blocks
// zeroed first, then each token's K and V rows copied into its slot.
//
// store_kv(kv_cache (2, KVH, NB, BS, D) contiguous, fresh_blocks (F,) int64, slots (T,) int64 (slot =
// block * BS + offset), key (T, KVH, D), value (T, KVH, D)), key and value in the cache's dtype.
// A compiled step (--enable_graph) calls it as one opaque in-place op, as it calls the Python custom op
// `write_kv` (still the path of an int8 cache), which costs ~90 us a layer in dispatch alone against a
// few microseconds here.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

void store_kv(torch::Tensor kv_cache, torch::Tensor fresh_blocks, torch::Tensor slots, torch::Tensor key,
              torch::Tensor value) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "store_kv: kv_cache must be a contiguous (2, KVH, NB, BS, D) tensor");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "store_kv: key and value must be in the cache's dtype");
  const int64_t kvh = kv_cache.size(1), nb = kv_cache.size(2), bs = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t t = slots.numel();
  TORCH_CHECK(key.dim() == 3 && key.size(0) == t && key.size(1) == kvh && key.size(2) == d && key.stride(2) == 1,
              "store_kv: key must be (T, KVH, D) with its last dimension contiguous");
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1, "store_kv: value must be shaped as key");
  auto sl = slots.to(torch::kLong).contiguous();
  auto fb = fresh_blocks.to(torch::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* fp = fb.data_ptr<int64_t>();
  const int64_t elem = kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t plane = kvh * nb * bs * d * elem, head = nb * bs * d * elem, row = d * elem;
  for (int64_t i = 0; i < fb.numel(); ++i) {
    TORCH_CHECK(fp[i] >= 0 && fp[i] < nb, "store_kv: fresh block ", fp[i], " out of range");
    for (int64_t p = 0; p < 2; ++p)
      for (int64_t h = 0; h < kvh; ++h) std::memset(base + p * plane + h * head + fp[i] * bs * row, 0, bs * row);
  }
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < nb * bs, "store_kv: slot ", sp[i], " out of range");
  const char* src[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const int64_t s0[2] = {key.stride(0) * elem, value.stride(0) * elem};
  const int64_t s1[2] = {key.stride(1) * elem, value.stride(1) * elem};
  at::parallel_for(0, t, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t p = 0; p < 2; ++p)
        for (int64_t h = 0; h < kvh; ++h)
          std::memcpy(base + p * plane + h * head + sp[i] * row, src[p] + i * s0[p] + h * s1[p], row);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("store_kv(Tensor(a!) kv_cache, Tensor fresh_blocks, Tensor slots, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("store_kv", &store_kv); }
