# The store's per-block records (blocks.pyx), for the batch loops that cimport them (batch.pyx).

cdef class Slot:
    # 8-byte fields first, then the 4-byte ones: 48 bytes after the object header, 64 in all
    cdef public object key
    cdef public Py_ssize_t offset
    cdef public unsigned long long handle
    cdef public Py_ssize_t refs
    cdef public double started
    cdef public unsigned int size       # bytes, <= MAX_SIZE (2 GiB, blocks.pyx)
    cdef public int state


cdef class PutHandle:
    cdef readonly Slot slot
    cdef public bint durable
    cdef object _buf
    cdef object _view
    cdef bint _closed
    cpdef close_view(self)


cdef class Entry:
    # as Slot: 48 bytes after the header, 64 in all; ``ek`` is a property (the key's encoding)
    cdef public object key
    cdef public long long version
    cdef public object ssd_version
    cdef public double pin_until
    cdef public double last_access
    cdef public unsigned int size       # bytes, <= MAX_SIZE
    cdef public bint hard


cdef PutHandle new_handle(Slot slot, object buf, bint durable)
