// TEST DOUBLE: a fake CUDA runtime standing in for libcudart, so the planned allocator's CUDA backend
// (cuda_backend.cpp, unchanged) can be built and driven on a machine with no GPU. It exists only
// because the real runtime cannot run where memplan's tests run; nothing here is used in training.
//
// What it models, and no more:
// * device memory: cudaMalloc/cudaFree on host memory. Freed memory is filled with 0xDB ("poison")
//   and quarantined (never handed out again), so a read after free sees poison; cudaFree counts as
//   a device-wide synchronisation, as the real one is.
// * an out-of-memory knob: a capacity in bytes, and "fail the next n cudaMalloc calls".
// * streams and events with vector clocks: each stream's clock counts its work; an event copies the
//   recording stream's clock vector; cudaStreamWaitEvent merges it into the waiting stream; a
//   synchronisation merges into the host's vector, which every later submission inherits.
// * kernels as byte-range accesses: fake_cuda_launch(stream, ptr, bytes, write) checks that every
//   earlier access to an overlapping range from another stream (a write, or a read when this one
//   writes) happens-before it; otherwise it is a violation (counted, first message kept).
// The control API (fake_cuda_*) is exported for the tests (ctypes and a C++ driver).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime_api.h"

struct CUstream_st {
    int id;
};
struct CUevent_st {
    std::vector<uint64_t> vc;
};

namespace {

constexpr unsigned char kPoison = 0xDB;

struct Access {
    uintptr_t start, end;
    int stream;
    uint64_t clock;
    bool write;
};

struct Fake {
    std::mutex mu;
    std::map<uintptr_t, size_t> live;        // device allocations: address -> bytes
    std::vector<std::pair<void*, size_t>> quarantine;  // freed (poisoned) allocations, kept until reset
    uint64_t capacity = UINT64_MAX;
    uint64_t live_bytes = 0;
    uint64_t fail_next = 0;
    cudaError_t last_error = cudaSuccess;
    int device = 0;
    // counters
    uint64_t mallocs = 0, frees = 0, failed_mallocs = 0, device_syncs = 0, stream_syncs = 0;
    uint64_t events_recorded = 0, waits = 0;
    std::vector<uint64_t> malloc_sizes;  // every cudaMalloc request, in order
    // streams: id 0 is the legacy default stream (nullptr)
    std::vector<CUstream_st*> streams{nullptr};
    std::vector<std::vector<uint64_t>> vc{std::vector<uint64_t>(1, 0)};
    std::vector<uint64_t> host;  // what the host has waited for
    std::vector<Access> accesses;
    uint64_t violations = 0;
    std::string first_violation;

    int id_of(cudaStream_t s) const { return s == nullptr ? 0 : s->id; }
    void widen(std::vector<uint64_t>& v) const { v.resize(streams.size(), 0); }
    static void merge(std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
        if (into.size() < from.size()) into.resize(from.size(), 0);
        for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
    }
    // Work submitted by the host to stream `s` comes after everything the host has waited for.
    std::vector<uint64_t>& submit(int s) {
        widen(vc[s]);
        merge(vc[s], host);
        return vc[s];
    }
    void sync_device() {
        device_syncs++;
        for (auto& v : vc) merge(host, v);
    }
    void fail(cudaError_t e) { last_error = e; }
};

Fake& F() {
    static Fake* f = new Fake();  // never destroyed: hooks may run during process exit
    return *f;
}

const char* name_of(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        default: return "unknown error";
    }
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------- the CUDA runtime API subset
cudaError_t cudaMalloc(void** devPtr, size_t size) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    f.mallocs++;
    f.malloc_sizes.push_back(size);
    if (devPtr == nullptr) return f.last_error = cudaErrorInvalidValue;
    *devPtr = nullptr;
    if (f.fail_next > 0 || f.live_bytes + size > f.capacity) {
        if (f.fail_next > 0) f.fail_next--;
        f.failed_mallocs++;
        return f.last_error = cudaErrorMemoryAllocation;
    }
    void* p = nullptr;
    if (posix_memalign(&p, 256, size == 0 ? 1 : size) != 0) {
        f.failed_mallocs++;
        return f.last_error = cudaErrorMemoryAllocation;
    }
    std::memset(p, 0xA5, size);  // "uninitialised" device memory, distinct from the poison
    f.live[(uintptr_t)p] = size;
    f.live_bytes += size;
    *devPtr = p;
    return cudaSuccess;
}

cudaError_t cudaFree(void* devPtr) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    f.sync_device();  // the real cudaFree synchronises the device
    if (devPtr == nullptr) return cudaSuccess;
    auto it = f.live.find((uintptr_t)devPtr);
    if (it == f.live.end()) return f.last_error = cudaErrorInvalidValue;
    size_t n = it->second;
    std::memset(devPtr, kPoison, n);
    f.quarantine.push_back({devPtr, n});
    f.live_bytes -= n;
    f.live.erase(it);
    f.frees++;
    uintptr_t a = (uintptr_t)devPtr, b = a + n;
    f.accesses.erase(std::remove_if(f.accesses.begin(), f.accesses.end(),
                                    [&](const Access& x) { return x.start < b && a < x.end; }),
                     f.accesses.end());
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    if (device == nullptr) return cudaErrorInvalidValue;
    *device = F().device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0) return F().last_error = cudaErrorInvalidValue;
    F().device = device;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    Fake& f = F();
    cudaError_t e = f.last_error;
    f.last_error = cudaSuccess;
    return e;
}

const char* cudaGetErrorString(cudaError_t error) { return name_of(error); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
    if (event == nullptr) return cudaErrorInvalidValue;
    *event = new CUevent_st();
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    delete event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    if (event == nullptr) return f.last_error = cudaErrorInvalidResourceHandle;
    event->vc = f.submit(f.id_of(stream));
    f.events_recorded++;
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    if (event == nullptr) return f.last_error = cudaErrorInvalidResourceHandle;
    Fake::merge(f.submit(f.id_of(stream)), event->vc);
    f.waits++;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    f.stream_syncs++;
    Fake::merge(f.host, f.vc[f.id_of(stream)]);
    return cudaSuccess;
}

// ---------------------------------------------------------------- control API for the tests
// A new stream (what torch.cuda.Stream() would create).
cudaStream_t fake_cuda_stream_create(void) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    auto* s = new CUstream_st{(int)f.streams.size()};
    f.streams.push_back(s);
    f.vc.emplace_back(f.streams.size(), 0);
    return s;
}

// A kernel on `stream` reading (write=0) or writing (write=1) [ptr, ptr+bytes). Returns 0 when every
// conflicting earlier access from another stream happens-before it, 1 otherwise (a violation).
int fake_cuda_launch(cudaStream_t stream, void* ptr, uint64_t bytes, int write) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    int s = f.id_of(stream);
    std::vector<uint64_t>& mine = f.submit(s);
    mine[s]++;
    uintptr_t a = (uintptr_t)ptr, b = a + bytes;
    int bad = 0;
    for (const Access& x : f.accesses) {
        if (x.stream == s || !(x.start < b && a < x.end) || (!write && !x.write)) continue;
        uint64_t seen = (size_t)x.stream < mine.size() ? mine[x.stream] : 0;
        if (seen >= x.clock) continue;
        bad = 1;
        f.violations++;
        if (f.first_violation.empty()) {
            char buf[256];
            std::snprintf(buf, sizeof buf,
                          "stream %d %s [%#lx, %#lx) while stream %d's %s of [%#lx, %#lx) (its work #%lu) may "
                          "still run: no event wait orders them",
                          s, write ? "writes" : "reads", (unsigned long)a, (unsigned long)b, x.stream,
                          x.write ? "write" : "read", (unsigned long)x.start, (unsigned long)x.end,
                          (unsigned long)x.clock);
            f.first_violation = buf;
        }
    }
    f.accesses.push_back({a, b, s, mine[s], write != 0});
    return bad;
}

// 1 when all `bytes` at `ptr` hold the poison of freed memory.
int fake_cuda_is_poisoned(const void* ptr, uint64_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(ptr);
    for (uint64_t i = 0; i < bytes; ++i)
        if (p[i] != kPoison) return 0;
    return 1;
}

void fake_cuda_set_capacity(uint64_t bytes) { F().capacity = bytes; }
void fake_cuda_fail_next_mallocs(uint64_t n) { F().fail_next = n; }

// Counters, by name; UINT64_MAX for an unknown name.
uint64_t fake_cuda_counter(const char* name) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    std::string n(name);
    if (n == "mallocs") return f.mallocs;
    if (n == "frees") return f.frees;
    if (n == "failed_mallocs") return f.failed_mallocs;
    if (n == "device_syncs") return f.device_syncs;
    if (n == "stream_syncs") return f.stream_syncs;
    if (n == "events_recorded") return f.events_recorded;
    if (n == "waits") return f.waits;
    if (n == "live_bytes") return f.live_bytes;
    if (n == "live_allocations") return f.live.size();
    if (n == "violations") return f.violations;
    return UINT64_MAX;
}

// How many cudaMalloc calls asked for exactly `bytes`.
uint64_t fake_cuda_mallocs_of(uint64_t bytes) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    return (uint64_t)std::count(f.malloc_sizes.begin(), f.malloc_sizes.end(), bytes);
}

const char* fake_cuda_first_violation(void) { return F().first_violation.c_str(); }

// Forget counters, accesses, the OOM knobs and the clocks (streams stay valid); free the quarantine.
// Live allocations stay live.
void fake_cuda_reset(void) {
    Fake& f = F();
    std::lock_guard<std::mutex> g(f.mu);
    for (auto& [p, n] : f.quarantine) std::free(p);
    f.quarantine.clear();
    f.capacity = UINT64_MAX;
    f.fail_next = 0;
    f.last_error = cudaSuccess;
    f.mallocs = f.frees = f.failed_mallocs = f.device_syncs = f.stream_syncs = 0;
    f.events_recorded = f.waits = 0;
    f.malloc_sizes.clear();
    f.accesses.clear();
    f.violations = 0;
    f.first_violation.clear();
    for (auto& v : f.vc) std::fill(v.begin(), v.end(), 0);
    f.host.clear();
}
}
