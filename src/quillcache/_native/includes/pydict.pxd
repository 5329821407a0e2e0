# cython: language_level=3
"""Dict calls by a known hash (qc_dict.h).  Get: a borrowed reference, or NULL with or
without an exception set (check PyErr_Occurred); Set and Del: 0, or -1 with an exception set."""
from cpython.ref cimport PyObject


cdef extern from "qc_dict.h":
    PyObject* QC_DictGetKnownHash(object d, object key, Py_hash_t hash)
    int QC_DictSetKnownHash(object d, object key, object value, Py_hash_t hash) except -1
    int QC_DictDelKnownHash(object d, object key, Py_hash_t hash) except -1
