/* Dict lookups and updates with the key's hash already taken (CPython's
 * _PyDict_{Get,Set,Del}Item_KnownHash: a borrowed reference or NULL, 0 or -1; errors are left
 * set).  A batch loop hashes a key once (PyObject_Hash: a Python-level __hash__ runs once) and
 * uses it in several dicts.  Where the interpreter does not export them, the plain calls stand
 * in (they hash again). */
#ifndef QC_DICT_H
#define QC_DICT_H
#include <Python.h>

#if PY_VERSION_HEX >= 0x030D0000
#define QC_DictGetKnownHash(d, k, h) PyDict_GetItemWithError((d), (k))
#define QC_DictSetKnownHash(d, k, v, h) PyDict_SetItem((d), (k), (v))
#define QC_DictDelKnownHash(d, k, h) PyDict_DelItem((d), (k))
#else
#define QC_DictGetKnownHash(d, k, h) _PyDict_GetItem_KnownHash((d), (k), (h))
#define QC_DictSetKnownHash(d, k, v, h) _PyDict_SetItem_KnownHash((d), (k), (v), (h))
#define QC_DictDelKnownHash(d, k, h) _PyDict_DelItem_KnownHash((d), (k), (h))
#endif

#endif
