/* vllm_kvguard._txn: the allocator transaction's per-call part, in C (optional).
 *
 * The same steps as the function rollback.make_fast_path() generates in Python (it is
 * used when this module is not built or KVGUARD_PURE_PYTHON=1): test the gate, record
 * the request's entries (a flat tuple, rollback._nest() gives record()'s form), open the
 * pool log (rollback's module global ``_log``), call vLLM's allocate_slots with the
 * caller's arguments as they came (vectorcall, no repacking), and on an Exception hand
 * everything to rollback._recover_flat() (Python) for the undo. Nothing else is done
 * here: the undo, its checks and its logging stay in Python.
 *
 * Record recipe (built by rollback._txn_ops(), same order as the generated Python):
 *   (RTB, dict, i)         block list of group i and its length (None, -1: absent)
 *   (GET, dict, None)      the request's value (None: absent)
 *   (IN, set, None)        whether the request is a member
 *   (LENATTR, obj, name)   len(getattr(obj, name))
 *   (WINDOW, i, nsb)       tuple of the last nsb entries of group i's list (() if empty)
 *   (CONST, value, None)   value
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

enum { OP_RTB = 0, OP_GET = 1, OP_IN = 2, OP_LENATTR = 3, OP_WINDOW = 4, OP_CONST = 5 };
#define MAX_GROUPS 16

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;          /* attributes (e.g. __kvguard_fast_path__) */
    PyObject *fn;            /* vLLM's allocate_slots, bound to the manager */
    PyObject *func;          /* fn's function and self (NULL: call fn as it is) */
    PyObject *self_arg;
    PyObject *disabled;      /* rollback._disabled (a list, never rebound): non-empty, off */
    PyObject *fallback;      /* runs the call while the gate is shut */
    PyObject *recover;       /* rollback._recover_flat */
    PyObject *disable;       /* rollback._disable */
    PyObject *plan;
    PyObject *manager;
    PyObject *globals;       /* rollback's module dict: holds _log */
    PyObject *tripped;       /* a set; non-empty: a patch tripped, gate shut */
    PyObject *ops;           /* the record recipe, a tuple */
    Py_ssize_t rec_len;
    int *codes;              /* ops' op codes, for the per-call loop */
} Txn;

static PyObject *str_log, *str_request, *str_request_id;

/* Every object a Transaction holds, for the collector's traverse and clear. */
#define TXN_OBJECTS(X) X(dict) X(fn) X(func) X(self_arg) X(disabled) X(fallback) \
    X(recover) X(disable) X(plan) X(manager) X(globals) X(tripped) X(ops)

static int
txn_traverse(Txn *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    TXN_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
txn_clear(Txn *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    TXN_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
txn_dealloc(Txn *self)
{
    PyObject_GC_UnTrack(self);
    txn_clear(self);
    PyMem_Free(self->codes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The request's entries before the call, as a flat tuple (new reference), or NULL. */
static PyObject *
build_record(Txn *self, PyObject *rid)
{
    PyObject *lists[MAX_GROUPS];
    Py_ssize_t lens[MAX_GROUPS];
    Py_ssize_t k = 0, nops = PyTuple_GET_SIZE(self->ops);
    PyObject *rec = PyTuple_New(self->rec_len);
    if (rec == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < nops; j++) {
        PyObject *op = PyTuple_GET_ITEM(self->ops, j);
        int code = self->codes[j];
        PyObject *obj = PyTuple_GET_ITEM(op, 1), *arg = PyTuple_GET_ITEM(op, 2);
        PyObject *item = NULL;
        switch (code) {
        case OP_RTB: {
            Py_ssize_t i = PyLong_AsSsize_t(arg);
            PyObject *b = PyDict_GetItemWithError(obj, rid);          /* borrowed */
            Py_ssize_t n = -1;
            if (b == NULL && PyErr_Occurred())
                goto fail;
            if (b != NULL && (n = PyObject_Length(b)) < 0)
                goto fail;
            lists[i] = b;
            lens[i] = n;
            item = b != NULL ? b : Py_None;
            Py_INCREF(item);
            PyTuple_SET_ITEM(rec, k++, item);
            item = PyLong_FromSsize_t(n);
            break;
        }
        case OP_GET:            /* an empty dict's table is not read (often cold) */
            item = PyDict_GET_SIZE(obj) ? PyDict_GetItemWithError(obj, rid) : NULL;
            if (item == NULL) {
                if (PyErr_Occurred())
                    goto fail;
                item = Py_None;
            }
            Py_INCREF(item);
            break;
        case OP_IN: {
            int member = PySet_GET_SIZE(obj) ? PySet_Contains(obj, rid) : 0;
            if (member < 0)
                goto fail;
            item = PyBool_FromLong(member);
            break;
        }
        case OP_LENATTR: {
            PyObject *value = PyObject_GetAttr(obj, arg);
            Py_ssize_t n;
            if (value == NULL)
                goto fail;
            n = PyObject_Length(value);
            Py_DECREF(value);
            if (n < 0)
                goto fail;
            item = PyLong_FromSsize_t(n);
            break;
        }
        case OP_WINDOW: {
            Py_ssize_t i = PyLong_AsSsize_t(obj), nsb = PyLong_AsSsize_t(arg);
            Py_ssize_t n = lens[i];
            if (n > 0) {
                PyObject *part = PySequence_GetSlice(lists[i], n > nsb ? n - nsb : 0, n);
                if (part == NULL)
                    goto fail;
                item = PySequence_Tuple(part);
                Py_DECREF(part);
            }
            else {
                item = PyTuple_New(0);
            }
            break;
        }
        case OP_CONST:
            item = obj;
            Py_INCREF(item);
            break;
        default:
            PyErr_SetString(PyExc_SystemError, "vllm-kvguard _txn: unknown record op");
            goto fail;
        }
        if (item == NULL)
            goto fail;
        PyTuple_SET_ITEM(rec, k++, item);
    }
    return rec;
fail:
    Py_DECREF(rec);     /* unfilled slots are NULL: tuple dealloc skips them */
    return NULL;
}

static int
set_log(PyObject *globals, PyObject *value)
{
    /* Keeps a pending exception (the finally of the Python version). */
    PyObject *type, *val, *tb;
    int rc;
    PyErr_Fetch(&type, &val, &tb);
    rc = PyDict_SetItem(globals, str_log, value);
    if (type != NULL) {
        if (rc < 0)
            PyErr_Clear();
        PyErr_Restore(type, val, tb);
    }
    return rc;
}

/* vLLM's call with the caller's arguments. When the caller left the slot before its
 * arguments free (PY_VECTORCALL_ARGUMENTS_OFFSET, as every call from Python code does),
 * the function is called with the manager put there for the time of the call (what a
 * bound method does, without its own vectorcall step). */
static PyObject *
call_vllm(Txn *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (self->func != NULL && (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET)) {
        PyObject **slot = (PyObject **)args - 1;
        PyObject *saved = *slot, *result;
        *slot = self->self_arg;
        result = PyObject_Vectorcall(self->func, slot, PyVectorcall_NARGS(nargsf) + 1,
                                     kwnames);
        *slot = saved;
        return result;
    }
    return PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
}

static PyObject *
txn_vectorcall(Txn *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *request = NULL, *rid, *rec, *log, *result;
    PyObject *current = PyDict_GetItemWithError(self->globals, str_log);

    if (current == NULL && PyErr_Occurred())
        return NULL;
    if ((current != NULL && current != Py_None) || PySet_GET_SIZE(self->tripped) > 0
            || PyList_GET_SIZE(self->disabled) > 0)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);

    if (nargs >= 1) {
        request = args[0];
    }
    else if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nkw; i++) {
            int eq = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), str_request);
            if (eq == 0) {
                request = args[nargs + i];
                break;
            }
        }
    }
    if (request == NULL)        /* let vLLM raise its own TypeError */
        return call_vllm(self, args, nargsf, kwnames);

    rid = PyObject_GetAttr(request, str_request_id);
    rec = rid != NULL ? build_record(self, rid) : NULL;
    if (rec == NULL) {
        PyObject *type, *val, *tb, *done;
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_XDECREF(rid);
            return NULL;
        }
        PyErr_Fetch(&type, &val, &tb);
        PyErr_NormalizeException(&type, &val, &tb);
        if (tb != NULL)
            PyException_SetTraceback(val, tb);
        done = PyObject_CallOneArg(self->disable, val);
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
        Py_XDECREF(rid);
        if (done == NULL)
            return NULL;
        Py_DECREF(done);
        return call_vllm(self, args, nargsf, kwnames);
    }

    log = PyList_New(0);
    if (log == NULL || PyDict_SetItem(self->globals, str_log, log) < 0) {
        Py_XDECREF(log);
        Py_DECREF(rec);
        Py_DECREF(rid);
        return NULL;
    }
    result = call_vllm(self, args, nargsf, kwnames);
    if (result == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *type, *val, *tb;
        PyErr_Fetch(&type, &val, &tb);
        PyErr_NormalizeException(&type, &val, &tb);
        if (tb != NULL)
            PyException_SetTraceback(val, tb);
        if (PyDict_SetItem(self->globals, str_log, Py_None) == 0) {
            PyObject *cargs[7] = {self->plan, rec, log, rid, self->manager, request, val};
            result = PyObject_Vectorcall(self->recover, cargs, 7, NULL);
        }
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
    }
    if (set_log(self->globals, Py_None) < 0) {
        Py_XDECREF(result);
        result = NULL;
    }
    Py_DECREF(log);
    Py_DECREF(rec);
    Py_DECREF(rid);
    return result;
}

static PyObject *
txn_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fn", "fallback", "recover", "disable", "plan", "manager",
                             "globals", "disabled", "tripped", "ops", NULL};
    PyObject *fn, *fallback, *recover, *disable, *plan, *manager, *globals, *disabled,
             *tripped, *ops;
    Py_ssize_t rec_len = 0, groups = 0;
    Txn *self;

    int *codes;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO!O!O!O!:Transaction", kwlist, &fn,
                                     &fallback, &recover, &disable, &plan, &manager,
                                     &PyDict_Type, &globals, &PyList_Type, &disabled,
                                     &PySet_Type, &tripped, &PyTuple_Type, &ops))
        return NULL;
    codes = PyMem_Calloc(PyTuple_GET_SIZE(ops) + 1, sizeof(int));
    if (codes == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(ops); j++) {
        PyObject *op = PyTuple_GET_ITEM(ops, j), *obj, *arg;
        const char *why = NULL;
        long code;
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3) {
            PyErr_SetString(PyExc_TypeError, "each record op is a 3-tuple");
            goto bad;
        }
        code = PyLong_AsLong(PyTuple_GET_ITEM(op, 0));
        if (code == -1 && PyErr_Occurred())
            goto bad;
        codes[j] = (int)code;
        obj = PyTuple_GET_ITEM(op, 1);
        arg = PyTuple_GET_ITEM(op, 2);
        switch (code) {
        case OP_RTB:            /* two items: the list and its length */
            if (!PyDict_Check(obj) || PyLong_AsSsize_t(arg) != groups || groups >= MAX_GROUPS)
                why = "RTB op: a dict and the next group index";
            groups++;
            rec_len++;
            break;
        case OP_GET:
            if (!PyDict_Check(obj))
                why = "GET op: a dict";
            break;
        case OP_IN:
            if (!PySet_Check(obj))
                why = "IN op: a set";
            break;
        case OP_LENATTR:
            if (!PyUnicode_Check(arg))
                why = "LENATTR op: an attribute name";
            break;
        case OP_WINDOW: {
            Py_ssize_t i = PyLong_AsSsize_t(obj), nsb = PyLong_AsSsize_t(arg);
            if (i < 0 || i >= groups || nsb < 0)
                why = "WINDOW op: an earlier group and a count";
            break;
        }
        case OP_CONST:
            break;
        default:
            why = "unknown record op";
        }
        if (why != NULL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, why);
            goto bad;
        }
        rec_len++;
    }
    self = (Txn *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto bad;
    self->vectorcall = (vectorcallfunc)txn_vectorcall;
    self->dict = NULL;
    self->codes = codes;
    self->fn = Py_NewRef(fn);
    if (PyMethod_Check(fn)) {
        self->func = Py_NewRef(PyMethod_GET_FUNCTION(fn));
        self->self_arg = Py_NewRef(PyMethod_GET_SELF(fn));
    }
    self->disabled = Py_NewRef(disabled);
    self->fallback = Py_NewRef(fallback);
    self->recover = Py_NewRef(recover);
    self->disable = Py_NewRef(disable);
    self->plan = Py_NewRef(plan);
    self->manager = Py_NewRef(manager);
    self->globals = Py_NewRef(globals);
    self->tripped = Py_NewRef(tripped);
    self->ops = Py_NewRef(ops);
    self->rec_len = rec_len;
    return (PyObject *)self;
bad:
    PyMem_Free(codes);
    return NULL;
}

static PyMemberDef txn_members[] = {
    {"fn", T_OBJECT, offsetof(Txn, fn), READONLY, "vLLM's bound allocate_slots"},
    {"record_length", T_PYSSIZET, offsetof(Txn, rec_len), READONLY, "items per record"},
    {NULL}
};

static PyTypeObject TxnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "vllm_kvguard._txn.Transaction",
    .tp_doc = "vLLM's allocate_slots for one KVCacheManager, run as a transaction.",
    .tp_basicsize = sizeof(Txn),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = txn_new,
    .tp_dealloc = (destructor)txn_dealloc,
    .tp_traverse = (traverseproc)txn_traverse,
    .tp_clear = (inquiry)txn_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Txn, vectorcall),
    .tp_dictoffset = offsetof(Txn, dict),
    .tp_members = txn_members,
};

static struct PyModuleDef txn_module = {
    PyModuleDef_HEAD_INIT, "_txn",
    "The allocator transaction's per-call part in C (see vllm_kvguard.fixes.rollback).", -1,
};

PyMODINIT_FUNC
PyInit__txn(void)
{
    PyObject *m;
    if (PyType_Ready(&TxnType) < 0)
        return NULL;
    str_log = PyUnicode_InternFromString("_log");
    str_request = PyUnicode_InternFromString("request");
    str_request_id = PyUnicode_InternFromString("request_id");
    if (!str_log || !str_request || !str_request_id)
        return NULL;
    m = PyModule_Create(&txn_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TxnType);
    if (PyModule_AddObject(m, "Transaction", (PyObject *)&TxnType) < 0) {
        Py_DECREF(&TxnType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "RTB", OP_RTB) || PyModule_AddIntConstant(m, "GET", OP_GET)
            || PyModule_AddIntConstant(m, "IN", OP_IN)
            || PyModule_AddIntConstant(m, "LENATTR", OP_LENATTR)
            || PyModule_AddIntConstant(m, "WINDOW", OP_WINDOW)
            || PyModule_AddIntConstant(m, "CONST", OP_CONST)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
