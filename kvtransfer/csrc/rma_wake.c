/* Completion of kvtransfer.ucx_rma's gets without Python on the thread that progresses UCX.
 *
 * Each `Rma.get` batch is a `rma_batch` (memory owned by Python, kept alive until the batch is
 * drained): `pending` counts its gets still in flight plus one reference the posting thread holds
 * until every get is posted. `rma_wake_complete` is the UCP send callback of every get
 * (user_data = the batch): it frees the request, records the first error and, when it drops the
 * last reference, pushes the batch onto its `rma_wake`'s done stack and writes the wake's eventfd,
 * which the asyncio loop watches (`loop.add_reader`). No lock, no allocation, no GIL.
 *
 * Plain C (no Python, torch or UCX headers; GCC/Clang __atomic builtins, so it also compiles as
 * C++, as torch's BuildExtension compiles it): the callback has UCP's ucp_send_nbx_callback_t
 * signature, `void (void *request, ucs_status_t status, void *user_data)`, and ucp_request_free
 * comes in as a pointer. kvtransfer/rma_wake.py mirrors both structs with ctypes: keep the layouts
 * in step.
 */
#include <sched.h>
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
