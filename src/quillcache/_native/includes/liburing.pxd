# cython: language_level=3
"""liburing declarations used by the WAL and the SSD read ring (through qc_uring.h, which
stubs them out when an extension is built without liburing: QC_HAVE_LIBURING=0)."""
from libc.stdint cimport int64_t, uint64_t, int32_t, uint32_t, uint8_t
from posix.uio cimport iovec


cdef extern from "qc_uring.h" nogil:
    # the C macro (not Cython's compile-time constant of the same name, which cythonize's
    # cache does not track): 1 when built against liburing
    int QC_URING_BUILT "QC_HAVE_LIBURING"

    unsigned IOSQE_IO_LINK
    unsigned IORING_FSYNC_DATASYNC
    unsigned IORING_TIMEOUT_ETIME_SUCCESS

    struct __kernel_timespec:
        int64_t tv_sec
        long long tv_nsec

    struct io_uring:
        pass

    struct io_uring_sqe:
        uint64_t user_data
        uint8_t flags

    struct io_uring_cqe:
        uint64_t user_data
        int32_t res
        uint32_t flags

    int io_uring_queue_init(unsigned entries, io_uring *ring, unsigned flags)
    void io_uring_queue_exit(io_uring *ring)
    io_uring_sqe *io_uring_get_sqe(io_uring *ring)
    void io_uring_prep_writev(io_uring_sqe *sqe, int fd, const iovec *iovecs, unsigned nr_vecs,
                              uint64_t offset)
    void io_uring_prep_fsync(io_uring_sqe *sqe, int fd, unsigned fsync_flags)
    void io_uring_sqe_set_flags(io_uring_sqe *sqe, unsigned flags)
    int io_uring_submit_and_wait(io_uring *ring, unsigned wait_nr)
    int io_uring_wait_cqe(io_uring *ring, io_uring_cqe **cqe_ptr)
    void io_uring_cqe_seen(io_uring *ring, io_uring_cqe *cqe)
    void io_uring_prep_read(io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, uint64_t offset)
    void io_uring_prep_timeout(io_uring_sqe *sqe, __kernel_timespec *ts, unsigned count, unsigned flags)
    void io_uring_sqe_set_data64(io_uring_sqe *sqe, uint64_t data)
    int io_uring_register_eventfd(io_uring *ring, int fd)
    int io_uring_submit(io_uring *ring)
    int io_uring_peek_cqe(io_uring *ring, io_uring_cqe **cqe_ptr)
