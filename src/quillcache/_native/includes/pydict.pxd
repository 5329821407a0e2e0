# cython: language_level=3
"""The dict lookup by a known hash (qc_dict.h): a borrowed reference, or NULL with or
without an exception set (check PyErr_Occurred)."""
from cpython.ref cimport PyObject


cdef extern from "qc_dict.h":
    PyObject* QC_DictGetKnownHash(object d, object key, Py_hash_t hash)
