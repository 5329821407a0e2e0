/* A dict lookup with the key's hash already taken (CPython's _PyDict_GetItem_KnownHash,
 * a borrowed reference or NULL; errors are left set).  A batch loop hashes a key once
 * (PyObject_Hash: a Python-level __hash__ runs once) and looks it up in several dicts.
 * Where the interpreter does not export it, the plain lookup stands in (it hashes again). */
#ifndef QC_DICT_H
#define QC_DICT_H
#include <Python.h>

#if PY_VERSION_HEX >= 0x030D0000 && !defined(_PyDict_GetItem_KnownHash)
#define QC_DictGetKnownHash(d, k, h) PyDict_GetItemWithError((d), (k))
#else
#define QC_DictGetKnownHash(d, k, h) _PyDict_GetItem_KnownHash((d), (k), (h))
#endif

#endif
