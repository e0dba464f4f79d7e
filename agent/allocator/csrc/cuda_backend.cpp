// CUDA backend of the planned allocator and the CUDAPluggableAllocator hooks (4-argument ABI).
//
//   void* mp_cuda_malloc(size_t size, int device, cudaStream_t stream)
//   void  mp_cuda_free(void* ptr, size_t size, int device, cudaStream_t stream)
//
// The hooks take no context pointer, so one core (one device) is installed process-wide with
// mp_cuda_install. Other devices get plain cudaMalloc/cudaFree. Cross-stream safety: the arena's
// layout is replayed in the order of one "primary" stream (the stream of the first allocation); an
// allocation on another stream waits for the primary's queued work, and the primary waits for the
// work queued on a stream that frees a block, so a range is never reused while a kernel on another
// stream may still touch it (same-stream reuse is ordered by the stream itself). CUDA graph capture
// is not supported (events are recorded outside any capture).
// NOT RUN in the session that wrote it (no GPU): compiled against CUDA headers only.
#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_set>

#include "planned_allocator.h"

namespace {

std::mutex g_mu;  // guards the globals below; the core has its own lock
mp_core* g_core = nullptr;
int g_device = -1;
bool g_have_primary = false;
cudaStream_t g_primary = nullptr;
cudaEvent_t g_event = nullptr;
std::unordered_set<void*> g_foreign;  // allocations for devices other than g_device

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

}  // namespace

extern "C" {

void* mp_backend_alloc(uint64_t bytes, uint64_t /*alignment: cudaMalloc gives >= 256 B*/, int device) {
    DeviceGuard guard(device);
    void* p = nullptr;
    if (cudaMalloc(&p, (size_t)bytes) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error so PyTorch sees a plain out-of-memory
        return nullptr;
    }
    return p;
}

void mp_backend_free(void* ptr, uint64_t /*bytes*/, int device) {
    DeviceGuard guard(device);
    cudaFree(ptr);
}

const char* mp_backend_name(void) { return "cuda"; }

void mp_cuda_install(mp_core* core, int device) {
    std::lock_guard<std::mutex> g(g_mu);
    g_core = core;
    g_device = device;
}

void* mp_cuda_malloc(size_t size, int device, cudaStream_t stream) {
    if (size == 0) return nullptr;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (g_core == nullptr || device != g_device) {
            DeviceGuard guard(device);
            void* p = nullptr;
            if (cudaMalloc(&p, size) != cudaSuccess) {
                cudaGetLastError();
                return nullptr;
            }
            g_foreign.insert(p);
            return p;
        }
        DeviceGuard guard(device);
        if (!g_have_primary) {
            g_primary = stream;
            g_have_primary = true;
        } else if (stream != g_primary) {
            wait_for(stream, g_primary);
        }
    }
    return mp_alloc(g_core, size);
}

void mp_cuda_free(void* ptr, size_t /*size*/, int device, cudaStream_t stream) {
    if (ptr == nullptr) return;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_foreign.find(ptr);
        if (it != g_foreign.end()) {
            g_foreign.erase(it);
            DeviceGuard guard(device);
            cudaFree(ptr);
            return;
        }
        if (g_core == nullptr) return;
        if (g_have_primary && stream != g_primary) {
            DeviceGuard guard(device);
            wait_for(g_primary, stream);
        }
    }
    mp_free(g_core, ptr);
}
}
