/* Rows between a contiguous buffer and scattered pool pages, for the reference kernels on CPU
 * (te_paged/kernels/native.py builds and loads this; the bytes are those of the torch path).
 *
 * Slot i of the buffer (page_bytes from buf + i * page_bytes) is page pages[i] of the pool, for
 * num_pages whole pages; a tail of tail_bytes (a last, partial page) follows in slot num_pages,
 * page pages[num_pages]. The copies are split into chunks of at most CHUNK bytes and shared
 * among num_threads OpenMP threads: the runtime torch's intra-op parallelism uses (its
 * libgomp.so.1 is already loaded when this library is), so no second thread pool competes
 * with torch's. A move too small to pay for a parallel region runs on the calling thread. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CHUNK ((int64_t)1 << 18)

void te_paged_move_pages(char *pool, char *buf, const int32_t *pages, int64_t num_pages,
                         int64_t page_bytes, int64_t tail_bytes, int32_t to_pool,
                         int32_t num_threads) {
    if (num_pages < 0 || page_bytes <= 0 || tail_bytes < 0 || tail_bytes >= page_bytes) return;
    const int64_t slots = num_pages + (tail_bytes > 0);
    const int64_t per_page = (page_bytes + CHUNK - 1) / CHUNK;
    const int64_t tasks = slots * per_page;
    const int threads = num_threads > 1 ? num_threads : 1;
    const int parallel = threads > 1 && tasks > 1 && num_pages * page_bytes + tail_bytes >= CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t slot = t / per_page, offset = (t % per_page) * CHUNK;
        const int64_t left = (slot < num_pages ? page_bytes : tail_bytes) - offset;
        if (left <= 0) continue; /* past the tail */
        const size_t n = (size_t)(left < CHUNK ? left : CHUNK);
        char *page = pool + (int64_t)pages[slot] * page_bytes + offset;
        char *row = buf + slot * page_bytes + offset;
        if (to_pool)
            memcpy(page, row, n);
        else
            memcpy(row, page, n);
    }
}
