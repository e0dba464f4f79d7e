// CUDA backend of the planned allocator and the CUDAPluggableAllocator hooks (4-argument ABI).
//
//   void* mp_cuda_malloc(size_t size, int device, cudaStream_t stream)
//   void  mp_cuda_free(void* ptr, size_t size, int device, cudaStream_t stream)
//
// The hooks take no context pointer, so one core (one device) is installed process-wide with
// mp_cuda_install. Other devices get plain cudaMalloc/cudaFree (no stream ordering is tracked for
// them, so they are not cached: cudaFree's device synchronisation is what makes their reuse safe).
//
// Cross-stream safety: the arena's layout is replayed in the order of one "primary" stream (the
// stream of the first allocation); an allocation on another stream waits for the primary's queued
// work, and the primary waits for the work queued on a stream that frees a block, so a range is
// never reused while a kernel on another stream may still touch it (same-stream reuse is ordered by
// the stream itself). The same rule covers cached plain blocks. CUDA graph capture is not supported
// (events are recorded outside any capture).
//
// Plain blocks of the installed device (fallbacks outside the arena) are cached by exact size: a
// free keeps the block for the next request of that size instead of calling cudaFree, which
// synchronises the whole device. When cudaMalloc fails the cache is emptied and the request retried
// once; mp_cuda_empty_cache releases it on demand (mp_destroy parks the arena there too).
//
// Out of memory: mp_cuda_malloc throws std::runtime_error ("CUDA out of memory ...") instead of
// returning a null pointer, which PyTorch's pluggable allocator does not check (it would become an
// illegal-address fault in the first kernel). PyTorch's Python bindings turn the exception into a
// RuntimeError with this message. The hooks are called from C++ (PyTorch), never through ctypes.
//
// Tested on CPU by building this file, unchanged, against a fake runtime (fake_cuda/); compiled
// against the real CUDA headers by scripts/check_cuda_build.sh. Never run on a GPU so far.
#include <cuda_runtime_api.h>

#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "planned_allocator.h"

namespace {

std::mutex g_mu;  // guards the hook globals below; the core has its own lock
mp_core* g_core = nullptr;
int g_device = -1;
bool g_have_primary = false;
cudaStream_t g_primary = nullptr;
cudaEvent_t g_event = nullptr;
std::unordered_map<void*, int> g_foreign;  // plain blocks for other devices (or before install) -> device

std::mutex g_cache_mu;  // guards the block cache (the core calls the backend under its own lock)
std::map<std::pair<int, uint64_t>, std::vector<void*>> g_cache;  // (device, bytes) -> free blocks
uint64_t g_cached_bytes = 0;
cudaError_t g_last_failure = cudaSuccess;

struct DeviceGuard {
    int prev = -1;
    explicit DeviceGuard(int device) {
        cudaGetDevice(&prev);
        if (prev != device) cudaSetDevice(device);
    }
    ~DeviceGuard() {
        int now = -1;
        cudaGetDevice(&now);
        if (now != prev && prev >= 0) cudaSetDevice(prev);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// `first` waits for all work queued so far on `second`.
void wait_for(cudaStream_t first, cudaStream_t second) {
    if (g_event == nullptr && cudaEventCreateWithFlags(&g_event, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        cudaStreamSynchronize(second);  // no event: fall back to a host-side wait (correct, slower)
        return;
    }
    cudaEventRecord(g_event, second);
    cudaStreamWaitEvent(first, g_event, 0);
}

// Release every cached block (each cudaFree synchronises the device). Caller holds g_cache_mu.
void empty_cache_locked() {
    for (auto& [key, blocks] : g_cache) {
        DeviceGuard guard(key.first);
        for (void* p : blocks) cudaFree(p);
        g_cached_bytes -= key.second * blocks.size();
    }
    g_cache.clear();
}

void* cached_alloc(uint64_t bytes, int device) {
    std::lock_guard<std::mutex> g(g_cache_mu);
    auto it = g_cache.find({device, bytes});
    if (it != g_cache.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        g_cached_bytes -= bytes;
        return p;
    }
    DeviceGuard guard(device);
    for (int attempt = 0; attempt < 2; ++attempt) {
        void* p = nullptr;
        cudaError_t err = cudaMalloc(&p, (size_t)bytes);
        if (err == cudaSuccess) return p;
        cudaGetLastError();  // clear the error so later, unrelated calls do not see it
        g_last_failure = err;
        if (attempt == 0 && g_cached_bytes > 0) {
            empty_cache_locked();  // cached blocks of other sizes may make room
        } else {
            break;
        }
    }
    return nullptr;
}

void cached_free(void* ptr, uint64_t bytes, int device) {
    std::lock_guard<std::mutex> g(g_cache_mu);
    g_cache[{device, bytes}].push_back(ptr);
    g_cached_bytes += bytes;
}

[[noreturn]] void throw_oom(size_t size, int device) {
    mp_stats st{};
    mp_core* core = nullptr;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (device == g_device) core = g_core;
    }
    if (core != nullptr) mp_get_stats(core, &st);
    uint64_t cached = 0;
    cudaError_t why = cudaSuccess;
    {
        std::lock_guard<std::mutex> g(g_cache_mu);
        cached = g_cached_bytes;
        why = g_last_failure;
    }
    char buf[640];
    std::snprintf(buf, sizeof buf,
                  "CUDA out of memory in memplan's planned allocator: could not allocate %zu bytes on device %d "
                  "(cudaMalloc: %s). Planned arena: %" PRIu64 " bytes reserved%s; plain allocations live: %" PRIu64
                  " bytes; cached: %" PRIu64
                  " bytes. The plan does not fit this device now: use a smaller batch or sequence, re-plan with "
                  "a lower memory limit, or use allocation='caching'.",
                  size, device, cudaGetErrorString(why), st.arena_bytes,
                  st.arena_reserve_failures > 0 && st.arena_bytes == 0 ? " (the arena could not be reserved)" : "",
                  st.device_bytes, cached);
    throw std::runtime_error(buf);
}

}  // namespace

extern "C" {

void* mp_backend_alloc(uint64_t bytes, uint64_t /*alignment: cudaMalloc gives >= 256 B*/, int device) {
    return cached_alloc(bytes, device);
}

void mp_backend_free(void* ptr, uint64_t bytes, int device) { cached_free(ptr, bytes, device); }

const char* mp_backend_name(void) { return "cuda"; }

void mp_cuda_install(mp_core* core, int device) {
    std::lock_guard<std::mutex> g(g_mu);
    g_core = core;
    g_device = device;
    g_have_primary = false;
    g_primary = nullptr;
}

// Release the cached plain blocks (cudaFree each). Returns the bytes released.
uint64_t mp_cuda_empty_cache(void) {
    std::lock_guard<std::mutex> g(g_cache_mu);
    uint64_t before = g_cached_bytes;
    empty_cache_locked();
    return before;
}

uint64_t mp_cuda_cached_bytes(void) {
    std::lock_guard<std::mutex> g(g_cache_mu);
    return g_cached_bytes;
}

void* mp_cuda_malloc(size_t size, int device, cudaStream_t stream) {
    if (size == 0) return nullptr;
    mp_core* core = nullptr;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (g_core != nullptr && device == g_device) {
            DeviceGuard guard(device);
            if (!g_have_primary) {
                g_primary = stream;
                g_have_primary = true;
            } else if (stream != g_primary) {
                wait_for(stream, g_primary);
            }
            core = g_core;
        } else {
            DeviceGuard guard(device);
            void* p = nullptr;
            cudaError_t err = cudaMalloc(&p, size);
            if (err == cudaSuccess) {
                g_foreign[p] = device;
                return p;
            }
            cudaGetLastError();
            std::lock_guard<std::mutex> c(g_cache_mu);
            g_last_failure = err;
        }
    }
    void* p = core == nullptr ? nullptr : mp_alloc(core, size);
    if (p == nullptr) throw_oom(size, device);  // outside g_mu: it reads the core's statistics
    return p;
}

void mp_cuda_free(void* ptr, size_t /*size*/, int device, cudaStream_t stream) {
    if (ptr == nullptr) return;
    mp_core* core = nullptr;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_foreign.find(ptr);
        if (it != g_foreign.end()) {
            DeviceGuard guard(it->second);
            g_foreign.erase(it);
            cudaFree(ptr);
            return;
        }
        if (g_core == nullptr) return;
        if (g_have_primary && stream != g_primary) {
            DeviceGuard guard(device);
            wait_for(g_primary, stream);
        }
        core = g_core;
    }
    mp_free(core, ptr);
}
}
