# cython: language_level=3
"""System declarations Cython's bundled posix/*.pxd do not carry."""

cdef extern from "<sys/file.h>" nogil:
    int flock(int fd, int operation)
    enum: LOCK_SH
    enum: LOCK_EX
    enum: LOCK_NB
    enum: LOCK_UN

cdef extern from "<limits.h>" nogil:
    enum: IOV_MAX

cdef extern from "<errno.h>" nogil:
    enum: ECANCELED
    enum: EWOULDBLOCK
    enum: EAGAIN
    enum: ETIME

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum: EFD_CLOEXEC
    enum: EFD_NONBLOCK

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    enum: MSG_DONTWAIT

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    enum: POLLIN
