/* C fast paths of the radix tree (sglang_sparse/tree/lcp.py), which falls back to its pure-Python
 * twins (same results) when this extension was not built:
 *
 * lcp(key, tokens, offset, start=0) -> int                       (twin: lcp.py:lcp_numpy)
 *     Number of leading positions i >= 0 with key[start + i] == tokens[offset + i], stopping at the
 *     shorter of key[start:] and tokens[offset:] (0 when either is empty or out of range). Both
 *     arguments are 1-D buffers of 4-byte signed integers (int32 numpy arrays, any stride); offset
 *     and start are token indices >= 0.
 *
 * walk(children, tokens, depth) -> (depth, path, versions)       (twin: lcp.py:walk_py)
 *     The pure descent of RadixTree.match, see spc_walk below.
 *
 * LCP method: a divergence in the first tokens is common (hint resumption, short leaf edges), so the
 * first LCP_HEAD tokens are compared one by one; then memcmp on blocks of LCP_BLOCK tokens (glibc
 * picks an SSE2/AVX2/EVEX memcmp at run time and exits at the first differing byte); the block that
 * differs is searched again with memcmp on LCP_SUB-token blocks and then element-wise (it is in L1
 * by then). Every token is compared exactly; a full match reads each buffer once and nothing is
 * allocated. Strided buffers take a plain element-wise loop.
 *
 * METH_FASTCALL and the buffer protocol (no numpy headers): ~0.1 us per call plus ~0.1 ns/token when
 * the buffers are in cache (a cold 32k-token compare is bound by memory bandwidth).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LCP_HEAD 16
#define LCP_BLOCK 1024 /* tokens (4 KiB) */
#define LCP_SUB 64     /* tokens (256 bytes) */

/* Common prefix length of two contiguous int32 runs of n tokens. */
static Py_ssize_t lcp_contiguous(const int32_t *a, const int32_t *b, Py_ssize_t n) {
    Py_ssize_t i = 0, blk = LCP_BLOCK;
    Py_ssize_t head = n < LCP_HEAD ? n : LCP_HEAD;
    for (; i < head; i++)
        if (a[i] != b[i]) return i;
    while (i < n) { /* blocks of LCP_BLOCK tokens; once one differs, narrow to LCP_SUB-token blocks */
        Py_ssize_t len = n - i < blk ? n - i : blk;
        if (memcmp(a + i, b + i, (size_t)len * sizeof(int32_t)) == 0) {
            i += len;
            continue;
        }
        if (blk == LCP_SUB) break; /* the difference is within these <= LCP_SUB tokens */
        blk = LCP_SUB;
    }
    for (; i < n; i++)
        if (a[i] != b[i]) return i;
    return n;
}

/* Common prefix length of two strided int32 runs of n tokens (strides in bytes). */
static Py_ssize_t lcp_strided(const char *a, Py_ssize_t sa, const char *b, Py_ssize_t sb, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t x, y;
        memcpy(&x, a + i * sa, sizeof x);
        memcpy(&y, b + i * sb, sizeof y);
        if (x != y) return i;
    }
    return n;
}

/* 1 if the buffer holds native 4-byte signed integers ("i", or "l" where long is 4 bytes). */
static int is_int32_format(const Py_buffer *v) {
    const char *f = v->format;
    if (v->itemsize != 4 || v->ndim != 1) return 0;
    if (f == NULL) return 0;
    if (*f == '@' || *f == '=') f++;
#if PY_LITTLE_ENDIAN
    else if (*f == '<') f++;
#else
    else if (*f == '>' || *f == '!') f++;
#endif
    return (f[0] == 'i' || (f[0] == 'l' && sizeof(long) == 4)) && f[1] == '\0';
}

static int get_tokens(PyObject *obj, Py_buffer *v, const char *what) {
    if (PyObject_GetBuffer(obj, v, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return -1;
    if (!is_int32_format(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int32 buffer (got format '%s', itemsize %zd)",
                     what, v->format ? v->format : "B", v->itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *spc_lcp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "lcp(key, tokens, offset, start=0) takes 3 or 4 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[2]);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = 0;
    if (nargs == 4) {
        start = PyLong_AsSsize_t(args[3]);
        if (start == -1 && PyErr_Occurred()) return NULL;
    }
    if (offset < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "lcp: offset and start must be >= 0");
        return NULL;
    }
    Py_buffer k, t;
    if (get_tokens(args[0], &k, "key") < 0) return NULL;
    if (get_tokens(args[1], &t, "tokens") < 0) {
        PyBuffer_Release(&k);
        return NULL;
    }
    Py_ssize_t nk = k.shape[0] - start, nt = t.shape[0] - offset;
    Py_ssize_t m = nk < nt ? nk : nt, r = 0;
    if (m > 0) {
        Py_ssize_t sk = k.strides ? k.strides[0] : 4, st = t.strides ? t.strides[0] : 4;
        const char *a = (const char *)k.buf + start * sk, *b = (const char *)t.buf + offset * st;
        if (sk == 4 && st == 4 && ((uintptr_t)a % _Alignof(int32_t)) == 0 &&
            ((uintptr_t)b % _Alignof(int32_t)) == 0)
            r = lcp_contiguous((const int32_t *)a, (const int32_t *)b, m);
        else
            r = lcp_strided(a, sk, b, st, m);
    }
    PyBuffer_Release(&t);
    PyBuffer_Release(&k);
    return PyLong_FromSsize_t(r);
}

/* walk(children, tokens, depth) -> (depth, path, versions): the pure descent of RadixTree.match.
 *
 * From the dict ``children`` (first token -> node), repeatedly take the child keyed by
 * tokens[depth], add lcp(child.key, tokens, depth) to depth and stop when the child's edge was not
 * fully matched, the tokens end or no child matches. ``path`` is the tuple of visited children (in
 * order), ``versions`` their ``version`` ints. Node attributes are read by name (``key``: a 1-D
 * int32 buffer, ``children``: a dict, ``version``), so any object with them works; same results as
 * lcp.py:walk_py. */
static PyObject *str_key, *str_children, *str_version;

static PyObject *spc_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "walk(children, tokens, depth) takes 3 arguments");
        return NULL;
    }
    PyObject *children = args[0];
    Py_ssize_t d = PyLong_AsSsize_t(args[2]);
    if (d == -1 && PyErr_Occurred()) return NULL;
    if (d < 0) {
        PyErr_SetString(PyExc_ValueError, "walk: depth must be >= 0");
        return NULL;
    }
    Py_buffer t;
    if (get_tokens(args[1], &t, "tokens") < 0) return NULL;
    const Py_ssize_t n = t.shape[0], st = t.strides ? t.strides[0] : 4;
    const char *tb = (const char *)t.buf;
    PyObject *path = PyList_New(0); /* owns the visited nodes */
    PyObject *result = NULL;
    if (path == NULL) goto done;
    while (d < n) {
        if (!PyDict_Check(children)) {
            PyErr_SetString(PyExc_TypeError, "walk: node.children must be a dict");
            goto done;
        }
        int32_t tok;
        memcpy(&tok, tb + d * st, sizeof tok);
        PyObject *pytok = PyLong_FromLong((long)tok);
        if (pytok == NULL) goto done;
        PyObject *child = PyDict_GetItemWithError(children, pytok); /* borrowed */
        Py_DECREF(pytok);
        if (child == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        if (PyList_Append(path, child) < 0) goto done;
        PyObject *key = PyObject_GetAttr(child, str_key);
        if (key == NULL) goto done;
        Py_buffer kb;
        int rc = get_tokens(key, &kb, "node.key");
        Py_DECREF(key);
        if (rc < 0) goto done;
        Py_ssize_t nk = kb.shape[0], nt = n - d, m = nk < nt ? nk : nt, k = 0;
        if (m > 0) {
            Py_ssize_t sk = kb.strides ? kb.strides[0] : 4;
            const char *a = (const char *)kb.buf, *b = tb + d * st;
            if (sk == 4 && st == 4 && ((uintptr_t)a % _Alignof(int32_t)) == 0 &&
                ((uintptr_t)b % _Alignof(int32_t)) == 0)
                k = lcp_contiguous((const int32_t *)a, (const int32_t *)b, m);
            else
                k = lcp_strided(a, sk, b, st, m);
        }
        PyBuffer_Release(&kb);
        d += k;
        if (k < nk) break;
        children = PyObject_GetAttr(child, str_children); /* the child (held by path) keeps it alive */
        if (children == NULL) goto done;
        Py_DECREF(children);
    }
    {
        Py_ssize_t np_ = PyList_GET_SIZE(path);
        PyObject *versions = PyTuple_New(np_);
        if (versions == NULL) goto done;
        for (Py_ssize_t i = 0; i < np_; i++) {
            PyObject *v = PyObject_GetAttr(PyList_GET_ITEM(path, i), str_version);
            if (v == NULL) {
                Py_DECREF(versions);
                goto done;
            }
            PyTuple_SET_ITEM(versions, i, v);
        }
        PyObject *tpath = PyList_AsTuple(path);
        if (tpath == NULL) {
            Py_DECREF(versions);
            goto done;
        }
        result = Py_BuildValue("(nNN)", d, tpath, versions);
    }
done:
    Py_XDECREF(path);
    PyBuffer_Release(&t);
    return result;
}

static PyMethodDef spc_methods[] = {
    {"lcp", (PyCFunction)(void (*)(void))spc_lcp, METH_FASTCALL,
     "lcp(key, tokens, offset, start=0) -> length of the common prefix of key[start:] and "
     "tokens[offset:] (1-D int32 buffers; offset, start >= 0)."},
    {"walk", (PyCFunction)(void (*)(void))spc_walk, METH_FASTCALL,
     "walk(children, tokens, depth) -> (depth, path, versions): the pure descent of RadixTree.match "
     "from the dict children (first token -> node) at token index depth."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef spc_module = {PyModuleDef_HEAD_INIT, "_lcp_native",
                                        "C longest-common-prefix of int32 token buffers (radix tree).", -1,
                                        spc_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lcp_native(void) {
    str_key = PyUnicode_InternFromString("key");
    str_children = PyUnicode_InternFromString("children");
    str_version = PyUnicode_InternFromString("version");
    if (str_key == NULL || str_children == NULL || str_version == NULL) return NULL;
    return PyModule_Create(&spc_module);
}
