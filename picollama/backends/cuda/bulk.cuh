// The bulk-copy engine and shared-memory barriers (sm_90 on): a producer sets a slot's
// byte count on its mbarrier (bar_expect) and issues cp.async.bulk copies that count their
// bytes off it as they land; consumers wait on the barrier's phase (bar_wait) and free the
// slot by arriving on another (bar_arrive). Used by ring.cu and stream_bench.py.
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
// barriers set up by this thread, made visible to the cluster and the bulk-copy engine
__device__ __forceinline__ void bar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// this block's rank in its cluster (0 in a launch without clusters)
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// BULK_WAIT_NS: a wait that has not ended after this long (2 s) is a bug (a copy that can
// never land, a consumer that never arrives, a count that never comes): the kernel traps,
// and the host gets a launch error instead of a hang. The timer is read every 1024 tries.
#ifndef BULK_WAIT_NS
#define BULK_WAIT_NS 2000000000ull
#endif
struct WaitBound {
    u32 tries = 0;
    u64 t0 = 0;
    __device__ __forceinline__ void tick() {
        if ((++tries & 1023u) != 0) return;
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t0 == 0) t0 = t;
        else if (t - t0 > BULK_WAIT_NS) __trap();
    }
};
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    const u32 a = smem_u32(bar);
    u32 done;
    WaitBound bound;
    do {
        bound.tick();
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
