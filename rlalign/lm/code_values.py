"""Values that cross the code sandbox's pipes: what a program returns, rebuilt outside as the same types.

    text = wire(value)     # in the program's process: the value as text
    value = unwire(text)   # outside (the checker, the trainer): the value again, built without running code

A plain value (numbers, strings, bytes, None, and lists, tuples, dicts, sets and frozensets of them)
crosses as its ``repr`` and is parsed back by :func:`literal`. Anything else a solution commonly
returns crosses as a tagged literal (``TYPED`` then a tree of tuples) and is rebuilt outside as the
real type, so that ``is``, ``==``, ``str``, ``type`` and arithmetic behave there as they do in Python
(``np.True_ is True`` is False, ``str`` of a ``Counter`` is a Counter's, ``np.float32(0.1) == 0.1``
is False):

============================  ==========================================================
numpy                         scalars and arrays of bool, int8..int64, uint8..uint64,
                              float16/32/64, complex64/128, str (``U``) and bytes (``S``)
collections                   ``Counter``, ``OrderedDict``, ``deque`` (with its maxlen),
                              ``defaultdict`` whose factory is a builtin type or None
namedtuples                   ``collections.namedtuple`` and ``typing.NamedTuple`` classes,
                              rebuilt by name and fields
============================  ==========================================================

Any other type (a class of the program's, a subclass of a builtin type, ``Decimal``, ``Fraction``,
a ``defaultdict`` with a lambda), anywhere in a value, crosses as a note that it is not rebuilt: its
case fails, whatever its ``repr`` (``class Id(int)`` would read as a plain int). The program's side may write anything, so nothing it writes is trusted: :func:`unwire`
builds only the types above, from plain literals, checking every tag, dtype, field name and size;
a program can claim a value it did not compute, which it could as well have returned.

Stdlib only (numpy imported where a numpy value arrives): the sandbox runs this file beside
rlalign.lm.code_harness.
"""

import _ast
import _thread
import sys

TYPED = "&"  # a value's text starts with this when it is a tagged literal (no repr of a plain value does)
INT_DIGITS = 100_000  # the longest int (in decimal digits) a value may carry, both ways (Python's own default: 4300)
MAX_DEPTH = 200  # nesting of a value, both ways
MAX_ARRAY_BYTES = 1 << 26  # a rebuilt numpy array's memory at most (a claimed dtype cannot inflate a short text past it)
_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_MAPPINGS = {"collections.Counter": "Counter", "collections.OrderedDict": "OrderedDict"}
_FACTORIES = {None: None, int: "int", float: "float", complex: "complex", str: "str", bytes: "bytes", bool: "bool",
              list: "list", tuple: "tuple", dict: "dict", set: "set", frozenset: "frozenset"}
_NUMPY_KINDS = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16), "U": None, "S": None}


def allow_long_ints():
    """Raise this process's limit on int <-> str conversions to :data:`INT_DIGITS` digits (never lower
    it): an honest value such as ``10 ** 5000`` must cross as its ``repr`` and be parsed back, which
    Python's default of 4300 digits refuses; the bound keeps the parse of a hostile value cheap. For
    the sandbox's processes, which are the harness's own; :func:`literal` leaves the trainer's limit as it is."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if 0 < limit < INT_DIGITS:
        sys.set_int_max_str_digits(INT_DIGITS)


_LIMIT_LOCK = _thread.allocate_lock()  # one parse at a time lifts the limit, and puts it back


def literal(text: str):
    """The plain Python literal ``text`` (what ``ast.literal_eval`` accepts, plus ``inf`` and ``nan`` as
    ``repr`` writes them), built without running any code; ints of up to :data:`INT_DIGITS` digits
    (the process's limit on int <-> str conversions is lifted for the parse only, then put back).
    Raises ValueError, TypeError, SyntaxError, RecursionError or MemoryError on anything else."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if limit == 0 or limit >= INT_DIGITS:
        tree = compile(text, "<value>", "eval", _ast.PyCF_ONLY_AST)
    else:
        with _LIMIT_LOCK:
            sys.set_int_max_str_digits(INT_DIGITS)
            try:
                tree = compile(text, "<value>", "eval", _ast.PyCF_ONLY_AST)
            finally:
                sys.set_int_max_str_digits(limit)
    return _literal(tree.body, 0)


def _literal(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError("literal nested too deep")
    kind = type(node)
    if kind is _ast.Constant and node.value is not Ellipsis:
        return node.value
    if kind in (_ast.List, _ast.Tuple, _ast.Set):
        items = [_literal(item, depth + 1) for item in node.elts]
        return list(items) if kind is _ast.List else tuple(items) if kind is _ast.Tuple else set(items)
    if kind is _ast.Dict and None not in node.keys:
        return {_literal(k, depth + 1): _literal(v, depth + 1) for k, v in zip(node.keys, node.values)}
    if kind is _ast.Name and node.id in ("inf", "nan"):
        return float(node.id)
    if kind is _ast.UnaryOp and type(node.op) in (_ast.USub, _ast.UAdd):
        value = _literal(node.operand, depth + 1)
        if type(value) in (int, float, complex):
            return -value if type(node.op) is _ast.USub else value
    if kind is _ast.BinOp and type(node.op) in (_ast.Add, _ast.Sub):  # complex numbers: 1+2j
        left, right = _literal(node.left, depth + 1), _literal(node.right, depth + 1)
        if type(left) in (int, float) and type(right) is complex:
            return left + right if type(node.op) is _ast.Add else left - right
    if kind is _ast.Call and type(node.func) is _ast.Name and node.func.id in ("set", "frozenset") and not node.keywords and len(node.args) <= 1:
        items = _literal(node.args[0], depth + 1) if node.args else ()
        if type(items) in (list, tuple, set):
            return set(items) if node.func.id == "set" else frozenset(items)
    raise ValueError("not a plain literal: " + type(node).__name__)


# ----------------------------------------------------------------------------------------------
# The program's side
# ----------------------------------------------------------------------------------------------


def wire(value) -> str:
    """``value`` as text: its ``repr`` when it is plain, else :data:`TYPED` and its tagged tree, else
    (a type :func:`unwire` does not rebuild somewhere inside) a tagged note of it, which fails outside:
    never the ``repr`` of such a value, which may read as a plain one (a subclass of ``int``)."""
    try:
        if _plain(value, 0):
            return repr(value)
        return TYPED + repr(_node(value, 0))
    except Exception as err:  # an unknown type somewhere inside, a value nested too deep
        return TYPED + repr(("unknown", str(err)[:200]))


def _plain(value, depth):
    kind = type(value)
    if kind in _ATOMS:
        return True
    if depth >= MAX_DEPTH:
        return False
    if kind in _SEQUENCES:
        return all(type(item) in _ATOMS or _plain(item, depth + 1) for item in value)
    if kind is dict:
        return all((type(k) in _ATOMS or _plain(k, depth + 1)) and (type(v) in _ATOMS or _plain(v, depth + 1)) for k, v in value.items())
    return False


def _node(value, depth):
    """The tagged tree of ``value``: ("=", plain value), or (tag, its parts as trees)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(value)
    if kind in _ATOMS:
        return ("=", value)
    if kind in _SEQUENCES or kind is dict:
        parts = [_node(item, depth + 1) for item in value] if kind is not dict else [(_node(k, depth + 1), _node(v, depth + 1)) for k, v in value.items()]
        flat = parts if kind is not dict else [node for pair in parts for node in pair]
        return ("=", value) if all(node[0] == "=" for node in flat) else (_SEQUENCES.get(kind, "dict"), parts)
    name = "%s.%s" % (kind.__module__, kind.__qualname__)
    if name in _MAPPINGS:  # its (key, value) pairs, in order, as one tree: ("=", [...]) when they are plain
        return (_MAPPINGS[name], _node(list(value.items()), depth + 1))
    if name == "collections.defaultdict":
        return ("defaultdict", _FACTORIES[value.default_factory], _node(list(value.items()), depth + 1))  # KeyError for another factory
    if name == "collections.deque":
        return ("deque", _node(list(value), depth + 1), value.maxlen)
    if kind.__bases__ == (tuple,) and isinstance(getattr(kind, "_fields", None), tuple):  # a namedtuple
        return ("namedtuple", kind.__name__, tuple(kind._fields), _node(list(value), depth + 1))
    numpy = sys.modules.get("numpy")
    if numpy is not None and (isinstance(value, numpy.generic) or kind is numpy.ndarray) and value.dtype.kind in _NUMPY_KINDS:
        if kind is not numpy.ndarray:
            return ("np", value.dtype.str, value.item())
        return ("ndarray", value.dtype.str, tuple(value.shape), value.ravel().tolist())
    raise TypeError("not rebuilt outside: " + name)


# ----------------------------------------------------------------------------------------------
# The trusted side
# ----------------------------------------------------------------------------------------------


def unwire(text: str):
    """The value :func:`wire` wrote as ``text``, of the same type, built from plain literals only.
    Raises what :func:`literal` raises, and ValueError for a tagged tree it does not rebuild."""
    if not text.startswith(TYPED):
        return literal(text)
    tree = literal(text[len(TYPED):])
    try:
        return _build(tree, 0)
    except (TypeError, OverflowError, KeyError, ImportError, AttributeError) as err:  # e.g. an unhashable key, an int past int8
        raise ValueError("not a value rebuilt here: %s: %s" % (type(err).__name__, err)) from None


def _build(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    if type(node) is not tuple or len(node) < 2 or type(node[0]) is not str or node[0] not in _BUILDERS:
        raise ValueError("not a tagged value: %.80r" % (node,))
    if node[0] == "=":
        if len(node) != 2:
            raise ValueError("a plain node holds one value")
        return node[1]
    return _BUILDERS[node[0]](depth + 1, *node[1:])


def _unknown(depth, what):
    raise ValueError("a value of a type not rebuilt here: %.200s" % (what,))


def _each(depth, nodes):
    """The values of a builtin container's list of trees."""
    if type(nodes) is not list:
        raise ValueError("a container's items come as a list")
    return [_build(node, depth) for node in nodes]


def _pairs_of(depth, nodes):
    """The (key, value) pairs of a dict's list of pairs of trees."""
    if type(nodes) is not list or not all(type(pair) is tuple and len(pair) == 2 for pair in nodes):
        raise ValueError("a dict comes as a list of (key, value) pairs")
    return [(_build(k, depth), _build(v, depth)) for k, v in nodes]


def _items(depth, node):
    """The items of a deque or namedtuple: one tree that builds to a list."""
    items = _build(node, depth)
    if type(items) is not list:
        raise ValueError("items come as a list")
    return items


def _pairs(depth, node):
    """The (key, value) pairs of a Counter, OrderedDict or defaultdict: one tree that builds to a list of pairs."""
    pairs = _items(depth, node)
    if not all(type(pair) is tuple and len(pair) == 2 for pair in pairs):
        raise ValueError("a mapping comes as a list of (key, value) pairs")
    return pairs


def _filled(mapping, pairs):
    for k, v in pairs:  # one at a time, in order: the program's insertion order (a Counter's repr and most_common follow it)
        mapping[k] = v
    return mapping


def _collections():
    import collections  # noqa: PLC0415 - only where a collections value arrives

    return collections


def _defaultdict(depth, factory, pairs):
    names = {name: kind for kind, name in _FACTORIES.items()}
    if not (factory is None or type(factory) is str) or factory not in names:
        raise ValueError("a defaultdict's factory is a builtin type or None, not %.40r" % (factory,))
    return _filled(_collections().defaultdict(names[factory]), _pairs(depth, pairs))


def _deque(depth, items, maxlen):
    if not (maxlen is None or (type(maxlen) is int and maxlen >= 0)):
        raise ValueError("a deque's maxlen is None or a count")
    return _collections().deque(_items(depth, items), maxlen)


def _namedtuple(depth, name, fields, items):
    if type(name) is not str or type(fields) is not tuple or not all(type(field) is str for field in fields):
        raise ValueError("a namedtuple comes as its name and field names")
    values = _items(depth, items)
    if len(values) != len(fields):
        raise ValueError("a namedtuple of %d fields holds %d values" % (len(fields), len(values)))
    return _namedtuple_class(name, fields)(*values)


_CLASSES = {}  # (name, fields) -> its namedtuple class, made once


def _namedtuple_class(name, fields):
    made = _CLASSES.get((name, fields))
    if made is None:  # namedtuple checks the name and fields: identifiers, no keyword, no leading underscore in a field, no repeat
        made = _collections().namedtuple(name, fields)
        if len(_CLASSES) < 1024:
            _CLASSES[(name, fields)] = made
    return made


def _numpy_dtype(text):
    """The numpy dtype written as ``text`` (``dtype.str``: "<i8", "|b1", "<U5"), of a kind in :data:`_NUMPY_KINDS` only."""
    if type(text) is not str or len(text) > 12 or text[:1] not in ("<", ">", "|", "=") or text[1:2] not in _NUMPY_KINDS \
            or not (text[2:].isascii() and text[2:].isdigit()):
        raise ValueError("not a numpy dtype rebuilt here: %.40r" % (text,))
    if "numpy" not in sys.modules:  # the sandbox's checker: one thread for numpy's maths libraries
        import os  # noqa: PLC0415

        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    import numpy  # noqa: PLC0415 - only where a numpy value arrives

    dtype = numpy.dtype(text)
    sizes = _NUMPY_KINDS[dtype.kind]
    if sizes is not None and dtype.itemsize not in sizes:  # e.g. float128: its item() is not a plain float
        raise ValueError("not a numpy dtype rebuilt here: %s" % text)
    return numpy, dtype


def _fits(dtype, value):
    """Whether the plain ``value`` is what ``item()`` / ``tolist()`` gives for ``dtype``'s kind."""
    kind = type(value)
    return {"b": kind is bool, "i": kind is int, "u": kind is int, "f": kind in (int, float), "c": kind in (int, float, complex),
            "U": kind is str, "S": kind is bytes}[dtype.kind]


def _numpy_scalar(depth, dtype_text, value):
    numpy, dtype = _numpy_dtype(dtype_text)
    if not _fits(dtype, value):
        raise ValueError("a %s scalar cannot hold %.40r" % (dtype_text, value))
    return dtype.type(value)


def _numpy_array(depth, dtype_text, shape, flat):
    numpy, dtype = _numpy_dtype(dtype_text)
    if type(shape) is not tuple or len(shape) > 32 or not all(type(n) is int and n >= 0 for n in shape) or type(flat) is not list:
        raise ValueError("an array comes as its shape and its items, flat")
    count = 1
    for n in shape:
        count *= n
    if count != len(flat) or not all(_fits(dtype, value) for value in flat):
        raise ValueError("an array of shape %r holds %d items of its dtype %s" % (shape, len(flat), dtype_text))
    if max(dtype.itemsize, 1) * count > MAX_ARRAY_BYTES:
        raise ValueError("an array over %d bytes" % MAX_ARRAY_BYTES)
    return numpy.array(flat, dtype=dtype).reshape(shape)


_BUILDERS = {
    "=": None,
    "list": lambda depth, nodes: _each(depth, nodes),
    "tuple": lambda depth, nodes: tuple(_each(depth, nodes)),
    "set": lambda depth, nodes: set(_each(depth, nodes)),
    "frozenset": lambda depth, nodes: frozenset(_each(depth, nodes)),
    "dict": lambda depth, nodes: dict(_pairs_of(depth, nodes)),
    "Counter": lambda depth, pairs: _filled(_collections().Counter(), _pairs(depth, pairs)),
    "OrderedDict": lambda depth, pairs: _filled(_collections().OrderedDict(), _pairs(depth, pairs)),
    "defaultdict": _defaultdict,
    "deque": _deque,
    "namedtuple": _namedtuple,
    "np": _numpy_scalar,
    "ndarray": _numpy_array,
    "unknown": _unknown,
}
