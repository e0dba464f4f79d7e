// Planned allocator core: serves a steady-state iteration's allocations at planned arena offsets.
//
// One `Core` owns one arena (reserved from a backend: host memory or a CUDA device) and a plan: the
// iteration's allocations in order ("slots": size, offset). A request is matched against the slot at
// the cursor; anything unplanned or mismatched falls back to a best-fit pool in the arena's free
// gaps, then to a plain backend allocation. An address range is never handed out twice while live.
// All sizes and offsets are in bytes. The C API (extern "C", for ctypes) is at the end.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// Matching and fallback rules, each switchable (for ablation and tests). Bits of `rules`.
enum {
    MP_RULE_LOOKAHEAD = 1,  // a request not matching the cursor's slot may match one of the next `lookahead` slots
    MP_RULE_SHRINK = 2,     // a request smaller than the cursor's slot is served inside that slot
    MP_RULE_POOL = 4,       // unplanned requests go to a best-fit pool in the arena's free gaps
    MP_RULE_GUARD = 8,      // the pool avoids ranges of the next `window` planned slots, unless the last
                            // `relax_after` requests all missed the plan (it is not being followed)
    MP_RULES_ALL = 15,
};

// Statistics, all counts or bytes. Layout mirrored by agent/allocator/library.py (_Stats).
typedef struct {
    uint64_t arena_bytes;            // bytes of the arena (0 until reserved on the first armed allocation)
    uint64_t reserved_bytes;         // arena + live plain backend allocations
    uint64_t peak_reserved_bytes;
    uint64_t allocated_bytes;        // live blocks, sizes rounded up to the alignment
    uint64_t peak_allocated_bytes;
    uint64_t requested_bytes;        // live blocks, sizes as requested
    uint64_t peak_requested_bytes;
    uint64_t device_bytes;           // live plain backend allocations (rounded)
    uint64_t peak_device_bytes;
    uint64_t allocs;                 // successful allocations (size > 0)
    uint64_t frees;
    uint64_t planned;                // served at the planned offset of the expected iteration slot (same rounded size)
    uint64_t persistent;             // served at the planned offset of a long-lived slot of the same size
    uint64_t shrunk;                 // served inside the larger slot at the cursor (MP_RULE_SHRINK)
    uint64_t resyncs;                // matched a later slot (MP_RULE_LOOKAHEAD); the slots in between are skipped
    uint64_t skipped_slots;          // slots passed over by resyncs or by begin_iteration
    uint64_t mismatches;             // requests during the iteration replay that matched no slot
    uint64_t displaced;              // a matching slot's range was still occupied (liveness differed)
    uint64_t pool_fallbacks;         // served by the best-fit pool in the arena's gaps
    uint64_t device_fallbacks;       // served by a plain backend allocation during the iteration replay
    uint64_t before_cycle_allocs;    // plain backend allocations before the first begin_iteration
    uint64_t iterations;             // completed passes over the slots
    uint64_t live_blocks;
    uint64_t unknown_frees;          // frees of pointers this allocator never handed out (ignored)
    uint64_t debug_violations;       // debug mode: overlapping live ranges or inconsistent frees found
    uint64_t failed_allocs;          // the backend had no memory (nullptr returned)
    uint64_t unguarded_pool_fallbacks;  // pool fallbacks made while the guard was lifted (after `relax_after` misses)
    uint64_t arena_reserve_failures;    // the backend could not reserve the arena (tried once, then on mp_reserve_arena)
} mp_stats;

typedef struct mp_core mp_core;

// Backend: reserve and release raw memory. Host: posix_memalign/free. CUDA: cudaMalloc/cudaFree.
void* mp_backend_alloc(uint64_t bytes, uint64_t alignment, int device);
void mp_backend_free(void* ptr, uint64_t bytes, int device);
const char* mp_backend_name(void);

// Create a core for `n_slots` planned allocations, in the iteration's allocation order, replayed by a
// cursor from each begin_iteration. `persistent[i]` != 0 marks a long-lived buffer (parameters,
// gradients, optimizer state): the cursor passes over it while it is held, and it is also matched by
// size out of order (e.g. parameters made before the first iteration), lowest offset first.
// Returns nullptr and sets mp_last_error() on invalid input.
mp_core* mp_create(uint64_t arena_bytes, uint64_t alignment, const uint64_t* sizes, const uint64_t* offsets,
                   const uint8_t* persistent, uint64_t n_slots, int device, uint32_t rules, uint64_t lookahead,
                   uint64_t window, uint64_t relax_after, int debug);
void mp_destroy(mp_core* core);  // releases the arena and every plain allocation still live
const char* mp_last_error(void);

void* mp_alloc(mp_core* core, uint64_t size);
int mp_free(mp_core* core, void* ptr);       // 0: freed; 1: unknown pointer (counted, ignored)
int mp_owns(mp_core* core, void* ptr);       // 1: a live block of this core
void mp_begin_iteration(mp_core* core);      // an iteration starts: the replay cursor goes to its first slot
uint64_t mp_cursor(mp_core* core);           // index (among the iteration's slots) of the next expected one
void* mp_arena_base(mp_core* core);          // nullptr until reserved
int mp_reserve_arena(mp_core* core);         // 0: reserved (or already), 1: backend out of memory (retries after a failure)
void mp_get_stats(mp_core* core, mp_stats* out);
void mp_reset_peaks(mp_core* core);
// Debug check of every invariant (arena tiled by live blocks and gaps, no overlapping live range,
// byte counters equal to the live blocks). 0: consistent; otherwise writes the first problem to `msg`.
int mp_check(mp_core* core, char* msg, uint64_t cap);
// Where a live block lives: 0 iteration slot, 1 long-lived slot, 2 shrunk, 3 pool, 4 plain backend, -1 not live.
int mp_block_kind(mp_core* core, void* ptr);

// Trace replay for benchmarks and tests: `ops[i]` >= 0 allocates buffer id ops[i] (sizes[id]),
// ops[i] < 0 frees id (-ops[i] - 1). Runs `iterations` passes, calling begin_iteration before each;
// allocations of ids still held (long-lived) are skipped. Frees what is live at the end when
// `free_at_end`. Returns 0, or 1 on a failed allocation or a bad op (see mp_last_error).
int mp_replay(mp_core* core, const int64_t* ops, uint64_t n_ops, const uint64_t* sizes, uint64_t n_ids,
              uint64_t iterations, int free_at_end);
}
