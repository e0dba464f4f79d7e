// Planned allocator core: plan replay, matching rules, gap-pool and backend fallback, statistics.
//
// Data structure: the arena [0, arena) is tiled by live arena blocks and free gaps. Gaps are kept
// twice: by offset (to test "is this range free" and to coalesce) and by (length, offset) (best fit).
// Every public function takes the core's mutex: PyTorch calls alloc/free from several threads (the
// autograd engine's device threads), so the core must be thread-safe.
#include "planned_allocator.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

thread_local std::string g_error;

enum Kind { kPlanned = 0, kPersistent = 1, kShrunk = 2, kPool = 3, kDevice = 4 };

struct Slot {
    uint64_t size;    // bytes as planned
    uint64_t extent;  // size rounded up to the alignment
    uint64_t offset;  // planned offset in the arena
    bool persistent;
    bool held;        // a live block was served from this slot
};

struct Block {
    uint64_t offset;     // arena offset (arena kinds) ; unused for kDevice
    uint64_t extent;     // rounded size
    uint64_t requested;  // size as requested
    int kind;
    int64_t slot;        // slot index, -1 when not served from a slot
};

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

struct mp_core {
    std::mutex mu;
    uint64_t alignment = 512;
    uint64_t arena_extent = 0;
    uint8_t* base = nullptr;
    int device = 0;
    uint32_t rules = MP_RULES_ALL;
    uint64_t lookahead = 16;
    uint64_t window = 64;
    uint64_t relax_after = 8;  // consecutive misses after which the pool's guard is lifted (0: never)
    uint64_t miss_run = 0;     // consecutive requests during the replay that missed the plan
    bool debug = false;
    bool reserve_failed = false;  // the arena's reservation failed once: not retried on every allocation
    bool cycling = false;   // replaying the iteration's slots (from the first begin_iteration on)
    std::vector<Slot> slots;
    std::vector<uint64_t> cyc;  // every slot, in allocation order (the order of the `sizes` given)
    uint64_t cursor = 0;        // index into cyc of the next expected allocation
    uint64_t n_persistent = 0, held_persistent = 0;
    std::map<uint64_t, std::set<std::pair<uint64_t, uint64_t>>> free_persistent;  // extent -> (offset, slot)
    std::map<uint64_t, uint64_t> gaps;                   // offset -> length
    std::set<std::pair<uint64_t, uint64_t>> gaps_by_len;  // (length, offset)
    std::unordered_map<uintptr_t, Block> live;            // address -> block
    std::vector<std::unordered_map<uintptr_t, Block>::node_type> spare;  // freed nodes, reused by alloc
    std::map<uintptr_t, uintptr_t> debug_ranges;          // debug mode: start -> end of every live block
    mp_stats st{};

    // ------------------------------------------------------------------ gaps
    void add_gap(uint64_t off, uint64_t len) {
        gaps[off] = len;
        gaps_by_len.insert({len, off});
    }
    void remove_gap(std::map<uint64_t, uint64_t>::iterator it) {
        gaps_by_len.erase({it->second, it->first});
        gaps.erase(it);
    }
    // Change a gap's length in place (its node in the length index is reused, not reallocated).
    void set_gap_len(std::map<uint64_t, uint64_t>::iterator it, uint64_t len) {
        auto node = gaps_by_len.extract({it->second, it->first});
        node.value() = {len, it->first};
        gaps_by_len.insert(std::move(node));
        it->second = len;
    }
    // Move a gap to a new start and length, reusing both nodes.
    void move_gap(std::map<uint64_t, uint64_t>::iterator it, uint64_t off, uint64_t len) {
        auto lnode = gaps_by_len.extract({it->second, it->first});
        auto gnode = gaps.extract(it);
        gnode.key() = off;
        gnode.mapped() = len;
        lnode.value() = {len, off};
        gaps.insert(std::move(gnode));
        gaps_by_len.insert(std::move(lnode));
    }
    // Take [off, off+len) out of the free gaps; false (nothing changed) when any byte is in use.
    bool occupy(uint64_t off, uint64_t len) {
        if (off + len > arena_extent) return false;
        auto it = gaps.upper_bound(off);
        if (it == gaps.begin()) return false;
        --it;
        uint64_t g_off = it->first, g_end = it->first + it->second;
        if (off < g_off || off + len > g_end) return false;
        bool left = off > g_off, right = off + len < g_end;
        if (left) {
            set_gap_len(it, off - g_off);
            if (right) add_gap(off + len, g_end - (off + len));
        } else if (right) {
            move_gap(it, off + len, g_end - (off + len));
        } else {
            remove_gap(it);
        }
        return true;
    }
    // Return [off, off+len) to the free gaps, merged with free neighbours.
    void release(uint64_t off, uint64_t len) {
        uint64_t end = off + len;
        auto next = gaps.lower_bound(off);
        bool merge_next = next != gaps.end() && next->first == end;
        auto prev = next;
        bool merge_prev = false;
        if (next != gaps.begin()) {
            prev = std::prev(next);
            merge_prev = prev->first + prev->second == off;
        }
        if (merge_prev && merge_next) {
            uint64_t total = prev->second + len + next->second;
            remove_gap(next);
            set_gap_len(prev, total);
        } else if (merge_prev) {
            set_gap_len(prev, prev->second + len);
        } else if (merge_next) {
            move_gap(next, off, len + next->second);
        } else {
            add_gap(off, len);
        }
    }

    // ------------------------------------------------------------------ plan replay
    // A long-lived slot that is held is not allocated again: the cursor passes over it.
    bool expected(uint64_t k) const { return !(slots[cyc[k]].persistent && slots[cyc[k]].held); }

    // Move the cursor to the next expected slot, wrapping around at the end of the iteration.
    // False when no slot is expected (every slot is a held long-lived one).
    bool settle() {
        if (cyc.empty() || (held_persistent == n_persistent && n_persistent == cyc.size())) return false;
        while (true) {
            if (cursor >= cyc.size()) {  // the plan's iteration is complete without begin_iteration: wrap
                cursor = 0;
                st.iterations++;
            }
            if (expected(cursor)) return true;
            cursor++;
        }
    }

    // Serve [off, off+extent) of the arena for slot `j` (-1: none); false when any byte is in use.
    bool serve(uint64_t off, uint64_t extent, uint64_t size, int kind, int64_t j, Block* b) {
        if (!occupy(off, extent)) return false;
        if (j >= 0) {
            Slot& s = slots[j];
            s.held = true;
            if (s.persistent) {
                free_persistent[s.extent].erase({s.offset, (uint64_t)j});
                held_persistent++;
            }
        }
        *b = Block{off, extent, size, kind, j};
        return true;
    }

    // The request is the allocation of slot cyc[k]; serve it at the slot's offset if that range is free.
    bool serve_slot(uint64_t k, uint64_t extent, uint64_t size, bool shrunk, Block* b) {
        cursor = k + 1;  // the slot's allocation happened, wherever it ends up being served
        int64_t j = (int64_t)cyc[k];
        int kind = shrunk ? kShrunk : slots[j].persistent ? kPersistent : kPlanned;
        if (serve(slots[j].offset, extent, size, kind, j, b)) {
            (kind == kPlanned ? st.planned : kind == kShrunk ? st.shrunk : st.persistent)++;
            miss_run = 0;
            return true;
        }
        st.displaced++;  // the range is still held: liveness differs from the plan
        miss_run++;
        return false;
    }

    // The matching rules, in order: (1) the expected slot at the cursor, same rounded size; (2) a free
    // long-lived slot of the same size, lowest offset first (parameters made before the replay starts,
    // gradients re-made in another order); (3) MP_RULE_SHRINK: inside the larger slot at the cursor
    // (a smaller batch or shorter sequence keeps the plan's order); (4) MP_RULE_LOOKAHEAD: one of
    // the next `lookahead` expected slots, same size, skipping the ones in between (an allocation the
    // program did not make this time). Shrink goes first because a scaled-down iteration often makes
    // sizes that coincide with later slots, which lookahead would mistake for a skip. Otherwise a
    // mismatch. A matched slot whose range is still occupied is "displaced" and the request falls back.
    bool serve_planned(uint64_t extent, uint64_t size, Block* b) {
        bool replay = cycling && settle();
        if (replay && slots[cyc[cursor]].extent == extent) return serve_slot(cursor, extent, size, false, b);
        auto it = free_persistent.find(extent);
        if (it != free_persistent.end() && !it->second.empty()) {
            auto [off, j] = *it->second.begin();
            if (serve(off, extent, size, kPersistent, (int64_t)j, b)) {
                st.persistent++;
                return true;
            }
            st.displaced++;
            return false;
        }
        if (!replay) return false;
        // (a long-lived slot qualifies too: traces taken from the CUDA caching allocator record block
        // sizes, which can exceed the request when a block was not split)
        if ((rules & MP_RULE_SHRINK) && slots[cyc[cursor]].extent > extent)
            return serve_slot(cursor, extent, size, true, b);
        if (rules & MP_RULE_LOOKAHEAD) {
            uint64_t seen = 0, skipped = 0;
            for (uint64_t k = cursor + 1; k < cyc.size() && seen < lookahead; ++k) {
                if (!expected(k)) continue;
                seen++;
                if (slots[cyc[k]].extent == extent) {
                    st.resyncs++;
                    st.skipped_slots += skipped + 1;  // the cursor's slot and the expected ones in between
                    return serve_slot(k, extent, size, false, b);
                }
                skipped++;
            }
        }
        st.mismatches++;
        miss_run++;
        return false;
    }

    // The guard is lifted while the program is not following the plan (a different batch size, say):
    // the next slots' ranges would not be used by their planned buffers anyway, and keeping them free
    // would only push requests out of the arena.
    bool guard_on() const {
        return (rules & MP_RULE_GUARD) && !(relax_after > 0 && miss_run >= relax_after);
    }

    // Does [off, off+len) overlap a range of the next `window` planned slots not yet served?
    bool conflicts_upcoming(uint64_t off, uint64_t len) const {
        if (!guard_on() || cyc.empty()) return false;
        uint64_t n = std::min<uint64_t>(window, cyc.size());
        for (uint64_t i = 0, j = cursor % cyc.size(); i < n; ++i, j = (j + 1) % cyc.size()) {
            const Slot& s = slots[cyc[j]];
            if (s.held) continue;
            if (off < s.offset + s.extent && s.offset < off + len) return true;
        }
        return false;
    }

    // Best fit among free gaps, at either end of the gap, avoiding the upcoming slots. UINT64_MAX: none.
    uint64_t pool_place(uint64_t extent) const {
        const int max_tries = 64;
        int tries = 0;
        for (auto it = gaps_by_len.lower_bound({extent, 0}); it != gaps_by_len.end() && tries < max_tries;
             ++it, ++tries) {
            uint64_t g_len = it->first, g_off = it->second;
            if (!conflicts_upcoming(g_off, extent)) return g_off;
            uint64_t top = g_off + g_len - extent;  // g_off and g_len are multiples of the alignment
            if (top != g_off && !conflicts_upcoming(top, extent)) return top;
        }
        return UINT64_MAX;
    }

    // ------------------------------------------------------------------ accounting
    void account_alloc(const Block& b) {
        st.allocs++;
        st.live_blocks++;
        st.allocated_bytes += b.extent;
        st.requested_bytes += b.requested;
        if (b.kind == kDevice) {
            st.device_bytes += b.extent;
            st.reserved_bytes += b.extent;
        }
        st.peak_allocated_bytes = std::max(st.peak_allocated_bytes, st.allocated_bytes);
        st.peak_requested_bytes = std::max(st.peak_requested_bytes, st.requested_bytes);
        st.peak_device_bytes = std::max(st.peak_device_bytes, st.device_bytes);
        st.peak_reserved_bytes = std::max(st.peak_reserved_bytes, st.reserved_bytes);
    }
    void account_free(const Block& b) {
        st.frees++;
        st.live_blocks--;
        st.allocated_bytes -= b.extent;
        st.requested_bytes -= b.requested;
        if (b.kind == kDevice) {
            st.device_bytes -= b.extent;
            st.reserved_bytes -= b.extent;
        }
    }
    void debug_insert(uintptr_t start, uintptr_t end) {
        auto next = debug_ranges.lower_bound(start);
        bool bad = next != debug_ranges.end() && next->first < end;
        if (next != debug_ranges.begin()) {
            auto prev = std::prev(next);
            bad = bad || prev->second > start;
        }
        if (bad) {
            st.debug_violations++;
            char buf[160];
            std::snprintf(buf, sizeof buf, "debug: new block [%#lx, %#lx) overlaps a live block", (unsigned long)start,
                          (unsigned long)end);
            g_error = buf;
        }
        debug_ranges[start] = end;
    }

    // Reserve the arena once. A failure is remembered: later allocations go straight to the plain
    // backend instead of asking the device for the whole arena again on every request (on CUDA each
    // failed cudaMalloc of the arena costs a driver call and may empty caches); mp_reserve_arena
    // retries explicitly.
    bool reserve() {
        if (base != nullptr || arena_extent == 0) return true;
        if (reserve_failed) return false;
        base = static_cast<uint8_t*>(mp_backend_alloc(arena_extent, alignment, device));
        if (base == nullptr) {
            reserve_failed = true;
            st.arena_reserve_failures++;
            return false;
        }
        st.arena_bytes = arena_extent;
        st.reserved_bytes += arena_extent;
        st.peak_reserved_bytes = std::max(st.peak_reserved_bytes, st.reserved_bytes);
        return true;
    }

    // ------------------------------------------------------------------ alloc / free
    void* alloc(uint64_t size) {
        if (size == 0) return nullptr;
        uint64_t extent = round_up(size, alignment);
        Block b{0, extent, size, kDevice, -1};
        bool served = false;
        if (reserve() && base != nullptr) {
            served = serve_planned(extent, size, &b);
            if (!served && cycling && (rules & MP_RULE_POOL)) {
                uint64_t off = pool_place(extent);
                served = off != UINT64_MAX && serve(off, extent, size, kPool, -1, &b);
                if (served) {
                    st.pool_fallbacks++;
                    if (!guard_on() && (rules & MP_RULE_GUARD)) st.unguarded_pool_fallbacks++;
                }
            }
        }
        void* ptr = nullptr;
        if (served) {
            ptr = base + b.offset;
        } else {
            ptr = mp_backend_alloc(extent, alignment, device);
            if (ptr == nullptr) {
                st.failed_allocs++;
                return nullptr;
            }
            b = Block{0, extent, size, kDevice, -1};
            (cycling ? st.device_fallbacks : st.before_cycle_allocs)++;
        }
        if (spare.empty()) {
            live.emplace((uintptr_t)ptr, b);
        } else {
            auto node = std::move(spare.back());
            spare.pop_back();
            node.key() = (uintptr_t)ptr;
            node.mapped() = b;
            live.insert(std::move(node));
        }
        account_alloc(b);
        if (debug) debug_insert((uintptr_t)ptr, (uintptr_t)ptr + extent);
        return ptr;
    }

    int free(void* ptr) {
        auto it = live.find((uintptr_t)ptr);
        if (it == live.end()) {
            st.unknown_frees++;
            if (debug) st.debug_violations++;
            return 1;
        }
        Block b = it->second;
        spare.push_back(live.extract(it));
        if (debug) {
            auto d = debug_ranges.find((uintptr_t)ptr);
            if (d == debug_ranges.end() || d->second != (uintptr_t)ptr + b.extent) st.debug_violations++;
            if (d != debug_ranges.end()) debug_ranges.erase(d);
        }
        if (b.kind == kDevice) {
            mp_backend_free(ptr, b.extent, device);
        } else {
            release(b.offset, b.extent);
            if (b.slot >= 0) {
                Slot& sl = slots[b.slot];
                sl.held = false;
                if (sl.persistent) {
                    free_persistent[sl.extent].insert({sl.offset, (uint64_t)b.slot});
                    held_persistent--;
                }
            }
        }
        account_free(b);
        return 0;
    }

    // An iteration starts: the slots the last one did not reach are skipped; the cursor goes to slot 0.
    void begin_iteration() {
        if (cycling) {
            for (uint64_t k = cursor; k < cyc.size(); ++k) st.skipped_slots += expected(k) ? 1 : 0;
            st.iterations++;
        }
        cycling = true;
        cursor = 0;
    }

    int check(std::string* why) {
        // 1. gaps and arena blocks tile [0, arena_extent) exactly
        std::vector<std::pair<uint64_t, uint64_t>> pieces;
        uint64_t alloc_ext = 0, req = 0, dev = 0;
        for (auto& [addr, b] : live) {
            alloc_ext += b.extent;
            req += b.requested;
            if (b.kind == kDevice) {
                dev += b.extent;
                if (base != nullptr && addr < (uintptr_t)base + arena_extent && addr + b.extent > (uintptr_t)base) {
                    *why = "a plain backend block overlaps the arena";
                    return 1;
                }
            } else {
                if (addr != (uintptr_t)base + b.offset) {
                    *why = "an arena block's address does not match its offset";
                    return 1;
                }
                pieces.push_back({b.offset, b.extent});
            }
        }
        if (gaps.size() != gaps_by_len.size()) {
            *why = "the two gap indexes disagree";
            return 1;
        }
        for (auto& [off, len] : gaps) pieces.push_back({off, len});
        std::sort(pieces.begin(), pieces.end());
        uint64_t at = 0;
        if (base != nullptr) {
            for (auto& [off, len] : pieces) {
                if (off != at) {
                    *why = off < at ? "two arena ranges overlap (live blocks or gaps)" : "arena bytes neither live nor free";
                    return 1;
                }
                at = off + len;
            }
            if (at != arena_extent) {
                *why = "arena blocks and gaps do not cover the arena";
                return 1;
            }
        }
        // 2. no two live blocks share a byte (arena or not)
        std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
        for (auto& [addr, b] : live) ranges.push_back({addr, addr + b.extent});
        std::sort(ranges.begin(), ranges.end());
        for (size_t i = 1; i < ranges.size(); ++i) {
            if (ranges[i].first < ranges[i - 1].second) {
                *why = "two live blocks share bytes";
                return 1;
            }
        }
        // 3. counters equal what is live
        if (alloc_ext != st.allocated_bytes || req != st.requested_bytes || dev != st.device_bytes ||
            live.size() != st.live_blocks || st.reserved_bytes != st.arena_bytes + dev) {
            *why = "byte counters disagree with the live blocks";
            return 1;
        }
        std::vector<char> held(slots.size(), 0);
        for (auto& [addr, b] : live)
            if (b.slot >= 0) held[b.slot]++;
        for (size_t j = 0; j < slots.size(); ++j) {
            if ((held[j] != 0) != slots[j].held || held[j] > 1) {
                *why = "a slot's held flag disagrees with the live blocks";
                return 1;
            }
        }
        if (debug && st.debug_violations != 0) {
            *why = "debug mode recorded violations: " + g_error;
            return 1;
        }
        return 0;
    }
};

extern "C" {

const char* mp_last_error(void) { return g_error.c_str(); }

mp_core* mp_create(uint64_t arena_bytes, uint64_t alignment, const uint64_t* sizes, const uint64_t* offsets,
                   const uint8_t* persistent, uint64_t n_slots, int device, uint32_t rules, uint64_t lookahead,
                   uint64_t window, uint64_t relax_after, int debug) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
        g_error = "alignment_bytes: must be a power of two, got " + std::to_string(alignment);
        return nullptr;
    }
    auto* c = new mp_core();
    c->alignment = alignment;
    c->arena_extent = round_up(arena_bytes, alignment);
    c->device = device;
    c->rules = rules;
    c->lookahead = lookahead;
    c->window = window;
    c->relax_after = relax_after;
    c->debug = debug != 0;
    c->slots.reserve(n_slots);
    for (uint64_t i = 0; i < n_slots; ++i) {
        if (sizes[i] == 0 || offsets[i] % alignment != 0 || offsets[i] + round_up(sizes[i], alignment) > c->arena_extent) {
            g_error = "slots[" + std::to_string(i) + "]: size " + std::to_string(sizes[i]) + " at offset " +
                      std::to_string(offsets[i]) + " is empty, unaligned or outside the arena of " +
                      std::to_string(c->arena_extent) + " bytes";
            delete c;
            return nullptr;
        }
        Slot s{sizes[i], round_up(sizes[i], alignment), offsets[i], persistent[i] != 0, false};
        c->slots.push_back(s);
        if (s.persistent) {
            c->free_persistent[s.extent].insert({s.offset, i});
            c->n_persistent++;
        }
        c->cyc.push_back(i);
    }
    if (c->arena_extent > 0) c->add_gap(0, c->arena_extent);
    c->live.reserve(2 * n_slots + 64);
    return c;
}

void mp_destroy(mp_core* c) {
    if (c == nullptr) return;
    for (auto& [addr, b] : c->live)
        if (b.kind == kDevice) mp_backend_free((void*)addr, b.extent, c->device);
    if (c->base != nullptr) mp_backend_free(c->base, c->arena_extent, c->device);
    delete c;
}

void* mp_alloc(mp_core* c, uint64_t size) {
    std::lock_guard<std::mutex> g(c->mu);
    return c->alloc(size);
}

int mp_free(mp_core* c, void* ptr) {
    std::lock_guard<std::mutex> g(c->mu);
    return c->free(ptr);
}

int mp_owns(mp_core* c, void* ptr) {
    std::lock_guard<std::mutex> g(c->mu);
    return c->live.count((uintptr_t)ptr) ? 1 : 0;
}

void mp_begin_iteration(mp_core* c) {
    std::lock_guard<std::mutex> g(c->mu);
    c->begin_iteration();
}

uint64_t mp_cursor(mp_core* c) {
    std::lock_guard<std::mutex> g(c->mu);
    return c->cursor;
}

void* mp_arena_base(mp_core* c) {
    std::lock_guard<std::mutex> g(c->mu);
    return c->base;
}

int mp_reserve_arena(mp_core* c) {
    std::lock_guard<std::mutex> g(c->mu);
    c->reserve_failed = false;  // an explicit request retries
    return c->reserve() ? 0 : 1;
}

void mp_get_stats(mp_core* c, mp_stats* out) {
    std::lock_guard<std::mutex> g(c->mu);
    *out = c->st;
}

void mp_reset_peaks(mp_core* c) {
    std::lock_guard<std::mutex> g(c->mu);
    c->st.peak_allocated_bytes = c->st.allocated_bytes;
    c->st.peak_requested_bytes = c->st.requested_bytes;
    c->st.peak_reserved_bytes = c->st.reserved_bytes;
    c->st.peak_device_bytes = c->st.device_bytes;
}

int mp_check(mp_core* c, char* msg, uint64_t cap) {
    std::lock_guard<std::mutex> g(c->mu);
    std::string why;
    int rc = c->check(&why);
    if (cap > 0) std::snprintf(msg, cap, "%s", why.c_str());
    return rc;
}

int mp_block_kind(mp_core* c, void* ptr) {
    std::lock_guard<std::mutex> g(c->mu);
    auto it = c->live.find((uintptr_t)ptr);
    return it == c->live.end() ? -1 : it->second.kind;
}

int mp_replay(mp_core* c, const int64_t* ops, uint64_t n_ops, const uint64_t* sizes, uint64_t n_ids,
              uint64_t iterations, int free_at_end) {
    std::vector<void*> ptrs(n_ids, nullptr);
    for (uint64_t it = 0; it < iterations; ++it) {
        mp_begin_iteration(c);
        for (uint64_t i = 0; i < n_ops; ++i) {
            int64_t op = ops[i];
            uint64_t id = op >= 0 ? (uint64_t)op : (uint64_t)(-op - 1);
            if (id >= n_ids) {
                g_error = "ops[" + std::to_string(i) + "]: buffer id " + std::to_string(id) + " out of range";
                return 1;
            }
            if (op >= 0) {
                if (ptrs[id] != nullptr) continue;  // long-lived, still held from an earlier iteration
                ptrs[id] = mp_alloc(c, sizes[id]);
                if (ptrs[id] == nullptr) {
                    g_error = "ops[" + std::to_string(i) + "]: allocation of " + std::to_string(sizes[id]) + " bytes failed";
                    return 1;
                }
            } else {
                if (ptrs[id] == nullptr) {
                    g_error = "ops[" + std::to_string(i) + "]: free of buffer " + std::to_string(id) + " that is not live";
                    return 1;
                }
                mp_free(c, ptrs[id]);
                ptrs[id] = nullptr;
            }
        }
    }
    if (free_at_end)
        for (void* p : ptrs)
            if (p != nullptr) mp_free(c, p);
    return 0;
}

}  // extern "C"
