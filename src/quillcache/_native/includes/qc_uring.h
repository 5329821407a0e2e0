/* qc_uring.h - make liburing optional for the WAL and the SSD read ring.
 *
 * setup.py defines QC_HAVE_LIBURING to 1 when pkg-config finds liburing.  When it
 * is 0 this header declares just enough of the liburing API (as stubs that fail
 * with -ENOSYS) for wal.pyx and ioring.pyx to compile; the WAL then runs on pwritev + fdatasync and the
 * SSD tier reads through its thread pool.
 */
#ifndef QC_URING_H
#define QC_URING_H

#ifndef QC_HAVE_LIBURING
#define QC_HAVE_LIBURING 0
#endif

#if QC_HAVE_LIBURING
#include <liburing.h>
#else
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define IOSQE_IO_LINK (1U << 2)
#define IORING_FSYNC_DATASYNC (1U << 0)
#define IORING_TIMEOUT_ETIME_SUCCESS (1U << 5)

struct __kernel_timespec { int64_t tv_sec; long long tv_nsec; };

struct io_uring { int qc_unused; };
struct io_uring_sqe { uint64_t user_data; uint8_t flags; };
struct io_uring_cqe { uint64_t user_data; int32_t res; uint32_t flags; };

static inline int io_uring_queue_init(unsigned entries, struct io_uring *ring, unsigned flags)
{ (void)entries; (void)ring; (void)flags; return -ENOSYS; }
static inline void io_uring_queue_exit(struct io_uring *ring) { (void)ring; }
static inline struct io_uring_sqe *io_uring_get_sqe(struct io_uring *ring) { (void)ring; return NULL; }
static inline void io_uring_prep_writev(struct io_uring_sqe *sqe, int fd, const struct iovec *iov,
                                        unsigned nr, uint64_t off)
{ (void)sqe; (void)fd; (void)iov; (void)nr; (void)off; }
static inline void io_uring_prep_fsync(struct io_uring_sqe *sqe, int fd, unsigned flags)
{ (void)sqe; (void)fd; (void)flags; }
static inline void io_uring_sqe_set_flags(struct io_uring_sqe *sqe, unsigned flags) { (void)sqe; (void)flags; }
static inline int io_uring_submit_and_wait(struct io_uring *ring, unsigned n) { (void)ring; (void)n; return -ENOSYS; }
static inline int io_uring_wait_cqe(struct io_uring *ring, struct io_uring_cqe **c)
{ (void)ring; *c = NULL; return -ENOSYS; }
static inline void io_uring_cqe_seen(struct io_uring *ring, struct io_uring_cqe *c) { (void)ring; (void)c; }
static inline void io_uring_prep_read(struct io_uring_sqe *sqe, int fd, void *buf, unsigned n, uint64_t off)
{ (void)sqe; (void)fd; (void)buf; (void)n; (void)off; }
static inline void io_uring_prep_timeout(struct io_uring_sqe *sqe, struct __kernel_timespec *ts,
                                         unsigned count, unsigned flags)
{ (void)sqe; (void)ts; (void)count; (void)flags; }
static inline void io_uring_sqe_set_data64(struct io_uring_sqe *sqe, uint64_t data) { (void)sqe; (void)data; }
static inline int io_uring_register_eventfd(struct io_uring *ring, int fd) { (void)ring; (void)fd; return -ENOSYS; }
static inline int io_uring_submit(struct io_uring *ring) { (void)ring; return -ENOSYS; }
static inline int io_uring_peek_cqe(struct io_uring *ring, struct io_uring_cqe **c)
{ (void)ring; *c = NULL; return -EAGAIN; }
#endif

#endif /* QC_URING_H */
