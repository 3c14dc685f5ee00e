#include "core/model/cpu_runtime.h"

#include <dlfcn.h>
#include <malloc.h>
#include <torch/torch.h>

namespace diloco {

void set_torch_threads(int threads) {
  torch::set_num_threads(threads);
  // libtorch does not forward its thread count to OpenBLAS; looked up at run time because the
  // BLAS libtorch was linked with may not be OpenBLAS.
  using SetThreads = void (*)(int);
  if (auto set_blas_threads =
          reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set_blas_threads(threads);
}

void retain_freed_memory() {
  // Allocations above the mmap threshold get their own mapping, returned to the kernel on free,
  // and the heap is trimmed once its free top exceeds the trim threshold. 1 GiB is above any
  // activation buffer of our configs, so both stop happening.
  constexpr int kBig = 1 << 30;
  mallopt(M_MMAP_THRESHOLD, kBig);
  mallopt(M_TRIM_THRESHOLD, kBig);
}

}  // namespace diloco
