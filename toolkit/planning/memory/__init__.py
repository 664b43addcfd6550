"""What each device allocates, in bytes, as llama.cpp does: `costs` (a plan's per-device weights, KV cache, state and
compute; the host's), `compute` (compute buffers from llama.cpp's graph allocator), `split` (what a split graph adds),
`inputs` (a split graph's architecture-dependent inputs, host-memory splits), `cuda` (what a CUDA card adds)."""
