// Host-memory backend of the planned allocator: the arena and plain fallbacks come from posix_memalign.
// Used by the CPU tests, the trace-replay benchmark and `agent.allocator.PlannedAllocator`.
#include <cstdlib>

#include "planned_allocator.h"

extern "C" {

void* mp_backend_alloc(uint64_t bytes, uint64_t alignment, int /*device*/) {
    void* p = nullptr;
    size_t a = alignment < sizeof(void*) ? sizeof(void*) : (size_t)alignment;
    return posix_memalign(&p, a, (size_t)bytes) == 0 ? p : nullptr;
}

void mp_backend_free(void* ptr, uint64_t /*bytes*/, int /*device*/) { std::free(ptr); }

const char* mp_backend_name(void) { return "host"; }
}
