/* Posting and completion of kvtransfer.ucx_rma's gets, without Python per get or per completion.
 *
 * Each `Rma.get` batch is a `rma_batch` (memory owned by Python, kept alive until the batch is
 * finished): `pending` counts its gets still in flight plus one reference the posting thread holds
 * until it is done with the batch. `rma_get` posts a batch's gets (`ucp_get_nbx`, one per run),
 * progresses the worker on the poster while UCP makes headway when the batch is small, and only
 * then lets its reference go: a batch that finished by then is the poster's to resolve and is never
 * queued. `rma_wake_complete` is the UCP send callback of every get (user_data = the batch): it frees
 * the request, records the first error and, when it drops the last reference, pushes the batch onto
 * its `rma_wake`'s done stack and writes the wake's eventfd, which the asyncio loop watches
 * (`loop.add_reader`). No lock, no allocation, no GIL.
 *
 * Plain C (no Python, torch or UCX headers; GCC/Clang __atomic builtins, so it also compiles as
 * C++, as torch's BuildExtension compiles it). UCP comes in as function pointers (`struct rma_ucp`,
 * filled once by Python), and `struct rma_request_param` mirrors UCX 1.21's ucp_request_param_t,
 * whose version kvtransfer/ucx_rma.py checks before anything here runs. kvtransfer/rma_wake.py
 * mirrors `rma_wake`, `rma_batch`, `rma_ucp` and `rma_run` with ctypes: keep the layouts in step,
 * and bump `rma_wake_abi` with any change Python must see (a stale build is then rebuilt).
 */
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

struct rma_batch;

struct rma_wake {
    struct rma_batch *done; /* finished batches not yet drained (a Treiber stack), atomic */
    void (*request_free)(void *request);
    int32_t efd;    /* eventfd (non-blocking) the loop watches; owned by Python */
    int32_t inside; /* callbacks running now (rma_wake_quiesce waits them out), atomic */
};

struct rma_batch {
    struct rma_batch *next; /* link in `wake->done`, written by whoever finished the batch */
    struct rma_wake *wake;
    int64_t pending; /* gets in flight + 1 while the poster still posts, atomic */
    int32_t status;  /* the first error (a negative ucs_status_t), 0 if none, atomic */
};

/* UCX 1.21's ucp_request_param_t (include/ucp/api/ucp.h), as a get fills it. */
struct rma_request_param {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *request;
    void (*cb)(void *request, int32_t status, void *user_data); /* ucp_send_nbx_callback_t */
    uint64_t datatype;
    void *user_data;
    void *reply_buffer;
    int32_t memory_type;
    void *recv_info;
    void *memh;
};

#define RMA_OP_ATTR_CALLBACK (1u << 1)
#define RMA_OP_ATTR_USER_DATA (1u << 2)
#define RMA_OP_ATTR_MEMH (1u << 8)
#define RMA_ERR_LAST (-100) /* UCS_ERR_LAST: status pointers in (-100, 0) are errors */

/* The libucp functions a batch needs, and the worker they act on. */
struct rma_ucp {
    void *(*get_nbx)(void *ep, void *buffer, size_t count, uint64_t remote_addr, void *rkey,
                     const struct rma_request_param *param);
    unsigned (*progress)(void *worker);
    int32_t (*signal)(void *worker);
    void *worker;
};

/* One get: `nbytes` from the peer's `remote` into our `local`. */
struct rma_run {
    uint64_t local;
    uint64_t remote;
    uint64_t nbytes;
};

/* What `rma_get` did with a batch (a negative value: pending, and ucp_worker_signal failed with it). */
enum { RMA_PENDING = 0, RMA_DONE_AT_POST = 1, RMA_DONE_INLINE = 2 };

/* Read from the built file by kvtransfer/rma_wake.py (not loaded: a process cannot unload a stale
 * build to load the rebuilt one under the same path). */
__attribute__((used)) const char rma_wake_abi[] = "rma_wake ABI 2";

static void record(struct rma_batch *b, int32_t status)
{
    int32_t ok = 0;
    if (status != 0)
        __atomic_compare_exchange_n(&b->status, &ok, status, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* UCP's callback of each get that returned a request, on whichever thread progresses the worker. */
void rma_wake_complete(void *request, int32_t status, void *user_data)
{
    struct rma_batch *b = (struct rma_batch *)user_data;
    struct rma_wake *w = b->wake;
    __atomic_fetch_add(&w->inside, 1, __ATOMIC_SEQ_CST);
    if (request != NULL) w->request_free(request);
    record(b, status);
    if (__atomic_fetch_sub(&b->pending, 1, __ATOMIC_SEQ_CST) == 1) {
        /* b is Python's to free once pushed: touch only w from here on */
        struct rma_batch *head = __atomic_load_n(&w->done, __ATOMIC_SEQ_CST);
        do {
            b->next = head;
        } while (!__atomic_compare_exchange_n(&w->done, &head, b, 1, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
        if (head == NULL) { /* the stack was empty: the loop may be asleep (see rma_wake_drain) */
            uint64_t one = 1;
            ssize_t n = write(w->efd, &one, sizeof one); /* EAGAIN only if the counter is full */
            (void)n;
        }
    }
    __atomic_fetch_sub(&w->inside, 1, __ATOMIC_SEQ_CST);
}

/* The poster's release, on the loop thread: drop `n` references (the gets that completed or failed
 * inside ucp_get_nbx, plus its own) with `status` their first error. Returns 1 if no reference is
 * left: the batch is then finished and NOT queued, the caller resolves it at once. */
int32_t rma_batch_release(struct rma_batch *b, int64_t n, int32_t status)
{
    record(b, status);
    return __atomic_fetch_sub(&b->pending, n, __ATOMIC_SEQ_CST) == n;
}

/* Post one get per run of batch `b` (its `pending` set to n + 1 by its creator) on endpoint `ep`
 * with remote key `rkey`; `memh`, when not NULL, is the registration the destinations lie in. A
 * batch of at most `inline_bytes` is then progressed here while UCP makes headway, at most
 * `inline_calls` calls and never past one that found nothing to do (so it never spins: over CMA
 * the copy runs on the poster, sparing two thread wake-ups; over a network lane the first idle call
 * hands it on). Returns RMA_DONE_AT_POST or RMA_DONE_INLINE when the batch finished here (its first
 * error in `b->status`; never queued: the caller resolves it), else RMA_PENDING after signalling the
 * worker so that UCXX's progress thread leaves epoll at once (the last completion queues the batch),
 * or the signal's negative status if that failed (the gets still complete, at the thread's timeout).
 * Called on the loop thread only; UCP may call `rma_wake_complete` on any thread meanwhile. */
int32_t rma_get(struct rma_batch *b, const struct rma_ucp *ucp, void *ep, void *rkey, void *memh,
                const struct rma_run *runs, int64_t n, int64_t inline_bytes, int32_t inline_calls)
{
    struct rma_request_param param = {0};
    int64_t released = 1, total = 0; /* the poster's hold, plus the gets done or failed at post */
    int32_t error = 0, progressed = 0;
    param.op_attr_mask = RMA_OP_ATTR_CALLBACK | RMA_OP_ATTR_USER_DATA | (memh ? RMA_OP_ATTR_MEMH : 0);
    param.cb = rma_wake_complete;
    param.user_data = b;
    param.memh = memh;
    for (int64_t i = 0; i < n; i++) {
        intptr_t status = (intptr_t)ucp->get_nbx(ep, (void *)(uintptr_t)runs[i].local, runs[i].nbytes,
                                                 runs[i].remote, rkey, &param);
        if (status == 0 || (status < 0 && status > RMA_ERR_LAST)) {
            released++;
            if (error == 0) error = (int32_t)status;
        } /* else: a request; UCP calls rma_wake_complete for it */
        total += (int64_t)runs[i].nbytes;
    }
    if (total <= inline_bytes) {
        /* gets still in flight = pending - released: only callbacks lower `pending`, and none can
         * drop it to zero while the poster's reference is held */
        for (int32_t k = 0; k < inline_calls && __atomic_load_n(&b->pending, __ATOMIC_SEQ_CST) > released; k++) {
            progressed = 1;
            if (ucp->progress(ucp->worker) == 0) break;
        }
    }
    if (rma_batch_release(b, released, error)) return progressed ? RMA_DONE_INLINE : RMA_DONE_AT_POST;
    int32_t status = ucp->signal(ucp->worker);
    return status < 0 ? status : RMA_PENDING;
}

/* The loop's reader: clear the eventfd, then take every finished batch (a list linked by `next`).
 * In that order: a batch pushed after the exchange finds the stack empty and writes again. */
struct rma_batch *rma_wake_drain(struct rma_wake *w)
{
    uint64_t count;
    ssize_t n = read(w->efd, &count, sizeof count); /* EAGAIN: nothing was written */
    (void)n;
    return __atomic_exchange_n(&w->done, (struct rma_batch *)NULL, __ATOMIC_SEQ_CST);
}

/* Before the eventfd is closed (every batch drained): wait out a callback still between its push
 * and its write, a few instructions and one syscall away. */
void rma_wake_quiesce(struct rma_wake *w)
{
    while (__atomic_load_n(&w->inside, __ATOMIC_SEQ_CST) != 0) sched_yield();
}

#ifdef __cplusplus
}
#endif
