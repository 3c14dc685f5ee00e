// Process-wide settings that make CPU training fast. Call both once at the start of a training
// process, before the first tensor is allocated.
#pragma once

namespace diloco {

// Intra-op threads of libtorch (and of OpenBLAS, which it calls for matrix products and which
// keeps its own thread pool). Small models train fastest on one thread per learner: the
// per-operation work is too small to amortise thread hand-offs, and learners on one machine
// compete for the same cores.
void set_torch_threads(int threads);

// Tells glibc malloc to keep freed memory instead of returning it to the OS. Every step frees and
// re-allocates the same activation buffers; with the default thresholds large ones go back to the
// kernel and come back as fresh zero-filled pages. Measured on configs/demo.toml, one thread:
// 0.36 -> 0.32 s/step (the gain grows with activation size; tiny is unaffected).
void retain_freed_memory();

}  // namespace diloco
