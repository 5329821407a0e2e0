# The store's per-block records (blocks.pyx), for the batch loops that cimport them (batch.pyx).

cdef class Slot:
    cdef public object key
    cdef public Py_ssize_t offset
    cdef public Py_ssize_t size
    cdef public unsigned long long handle
    cdef public Py_ssize_t refs
    cdef public int state
    cdef public double started


cdef class PutHandle:
    cdef readonly Slot slot
    cdef public bint durable
    cdef object _buf
    cdef object _view
    cdef bint _closed
    cpdef close_view(self)


cdef class Entry:
    cdef public object key
    cdef public object ek
    cdef public Py_ssize_t size
    cdef public long long version
    cdef public object ssd_version
    cdef public double pin_until
    cdef public bint hard
    cdef public double last_access


cdef PutHandle new_handle(Slot slot, object buf, bint durable)
