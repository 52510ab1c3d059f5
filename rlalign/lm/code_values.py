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
numpy scalars                 bool, int8..int64, uint8..uint64 (each C type: ``longlong``
                              stays ``longlong``), float16/32/64, complex64/128, ``str_``,
                              ``bytes_`` (trailing NULs kept)
collections                   ``Counter``, ``OrderedDict``, ``deque`` (with its maxlen),
                              ``defaultdict`` whose factory is a builtin type or None
namedtuples                   ``collections.namedtuple`` and ``typing.NamedTuple`` classes
                              with namedtuple's own methods, rebuilt by name and fields
                              (at most :data:`MAX_FIELDS`)
============================  ==========================================================

Any other type (a class of the program's, a subclass of any type above or of a builtin type, a
namedtuple with a ``__repr__`` or ``__eq__`` of its own, a numpy array, ``Decimal``, ``Fraction``,
a ``defaultdict`` with a lambda), anywhere in a value, crosses as a note that it is not rebuilt: its
case fails, whatever its ``repr`` (``class Id(int)`` would read as a plain int). Numpy arrays are
left out on purpose: their size is not their text's (a shape with a zero in it, a string dtype's
width, broadcasting in the check), and the check of the asserts format runs in the trainer.
Everything rebuilt here is at most a constant times its text in memory.

The program's side may write anything, so nothing it writes is trusted: :func:`unwire` builds only
the types above, from plain literals, checking every tag, dtype, field name and size; a program can
claim a value it did not compute, which it could as well have returned.

What a copy cannot keep: identity (``x is y`` for two values that were one object; two values of one
namedtuple class, returned by two calls, are of two classes here, as if the class were made per
call), an argument the program mutated in place (the check's own value is unchanged), and the order
in which a set was iterated when it differs from the order a fresh set of the same items iterates in.

Stdlib only (numpy imported where a numpy value arrives): in the sandbox this module runs first, in
the globals of rlalign.lm.code_harness (rlalign.lm.code_formats.HARNESS).
"""

import _ast
import _thread
import sys

TYPED = "&"  # a value's text starts with this when it is a tagged literal (no repr of a plain value does)
INT_DIGITS = 100_000  # the longest int (in decimal digits) a value may carry, both ways (Python's own default: 4300)
MAX_DEPTH = 200  # nesting of a value, both ways
MAX_FIELDS = 255  # fields of a namedtuple rebuilt here
MAX_COLLISIONS = 1000  # items of a set (keys of a dict) whose hash another one has: building it takes time quadratic in them
_ATOMS = frozenset(map(id, (int, float, complex, str, bytes, bool, type(None))))  # by id: a metaclass cannot answer for a class
_SEQUENCES = {id(list): "list", id(tuple): "tuple", id(set): "set", id(frozenset): "frozenset"}
_FACTORIES = {None: None, int: "int", float: "float", complex: "complex", str: "str", bytes: "bytes", bool: "bool",
              list: "list", tuple: "tuple", dict: "dict", set: "set", frozenset: "frozenset"}
_FACTORY_NAMES = {id(kind): name for kind, name in _FACTORIES.items()}
_NUMPY_CHARS = "?bBhHiIlLqQefdFDUS"  # numpy scalar types by dtype.char: bool, the C ints, float16/32/64, complex64/128, str_, bytes_
_KINDS = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float), "c": (int, float, complex), "U": (str,), "S": (bytes,)}


def allow_long_ints():
    """Raise this process's limit on int <-> str conversions to :data:`INT_DIGITS` digits (never lower
    it): an honest value such as ``10 ** 5000`` must cross as its ``repr`` and be parsed back, which
    Python's default of 4300 digits refuses; the bound keeps the parse of a hostile value cheap. The
    sandbox's processes raise it, and :func:`literal` raises it in the trainer, once for the process:
    a check outside (``len(str(f())) == 5001``) then answers as the program's Python does."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if 0 < limit < INT_DIGITS:
        sys.set_int_max_str_digits(INT_DIGITS)


_LIMIT_LOCK = _thread.allocate_lock()  # where the process has no limit (0) or a higher one: one parse at a time bounds it
_NUMERIC = frozenset("0123456789.+-eE[], ")  # a text of these is numbers in (nested) lists, which JSON reads as Python does
_NOT_BRACKETS = str.maketrans("", "", "0123456789.+-eE, ")
NUMERIC_FAST = 256  # from this length a numeric text is read by json where it is loaded (the trainer): no syntax tree


def literal(text: str):
    """The plain Python literal ``text`` (what ``ast.literal_eval`` accepts, plus ``inf`` and ``nan`` as
    ``repr`` writes them), built without running any code; ints of up to :data:`INT_DIGITS` digits
    (:func:`allow_long_ints`; a process with no limit, or a higher one, gets this one for the parse).
    Raises ValueError, TypeError, SyntaxError, RecursionError, OverflowError or MemoryError on anything else.

    Numbers in lists (``[1, -2.5, [3e+20]]``), the long values programs return most, are read by
    ``json.loads`` where ``json`` is loaded and the text is long: the same values (ints, floats as
    ``float()`` rounds them, lists), without the syntax tree a parse builds, about 0.2 GB a MiB of
    text. A text JSON refuses there (``[1,]``, ``.5``, ``+1``), or nested deeper than :data:`MAX_DEPTH`,
    is parsed as Python."""
    allow_long_ints()
    limit = getattr(sys, "get_int_max_str_digits", lambda: INT_DIGITS)()
    if limit == INT_DIGITS:
        return _parse(text)
    with _LIMIT_LOCK:
        sys.set_int_max_str_digits(INT_DIGITS)
        try:
            return _parse(text)
        finally:
            sys.set_int_max_str_digits(limit)


def _parse(text):
    json = sys.modules.get("json")
    if json is not None and len(text) >= NUMERIC_FAST and _NUMERIC.issuperset(text) and _shallow(text.translate(_NOT_BRACKETS)):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # not JSON: Python's own syntax decides
            pass
    return _literal(compile(text, "<value>", "eval", _ast.PyCF_ONLY_AST).body, 0)


def _shallow(brackets):
    """Whether a text whose brackets are ``brackets`` nests at most :data:`MAX_DEPTH` deep (as the
    Python parse allows: json alone would go as deep as the recursion limit lets it)."""
    if len(brackets) <= MAX_DEPTH:
        return True
    depth = 0
    for bracket in brackets:
        depth += 1 if bracket == "[" else -1
        if depth > MAX_DEPTH:
            return False
    return True


def _spread(keys: list) -> list:
    """``keys`` for a set or a dict, unless more than :data:`MAX_COLLISIONS` share a hash with another:
    ints that differ by multiples of 2**61 - 1 all hash alike, and a set of 20,000 of them (half a MiB
    of text) took the trainer 2 s to build, growing with the square of their number, every case (a
    repr has each item once, so honest values never come near). Raises ValueError, or TypeError for an unhashable key as ``set`` would."""
    if len(keys) > MAX_COLLISIONS and len(keys) - len(set(map(hash, keys))) > MAX_COLLISIONS:
        raise ValueError(f"a set or dict whose keys' hashes collide ({len(keys)} keys)")
    return keys


def _literal(node, depth):
    if depth > MAX_DEPTH:
        raise ValueError("literal nested too deep")
    kind = type(node)
    if kind is _ast.Constant and node.value is not Ellipsis:
        return node.value
    if kind in (_ast.List, _ast.Tuple, _ast.Set):
        items = [_literal(item, depth + 1) for item in node.elts]
        return list(items) if kind is _ast.List else tuple(items) if kind is _ast.Tuple else set(_spread(items))
    if kind is _ast.Dict and None not in node.keys:
        keys = _spread([_literal(k, depth + 1) for k in node.keys])
        return dict(zip(keys, [_literal(v, depth + 1) for v in node.values]))
    if kind is _ast.Name and node.id in ("inf", "nan"):
        return float(node.id)
    if kind is _ast.UnaryOp and type(node.op) in (_ast.USub, _ast.UAdd):
        value = _literal(node.operand, depth + 1)
        if type(value) is complex and type(node.op) is _ast.USub and type(node.operand) is _ast.Constant:
            return complex(value.real, -value.imag)  # repr's "-2j" is complex(0.0, -2.0), not -(2j) = (-0-2j)
        if type(value) in (int, float, complex):
            return -value if type(node.op) is _ast.USub else value
    if kind is _ast.BinOp and type(node.op) in (_ast.Add, _ast.Sub):  # complex numbers as repr writes them: (1+2j), (-0-0j)
        left, right = _literal(node.left, depth + 1), _literal(node.right, depth + 1)
        if type(left) in (int, float) and type(right) is complex and right.real == 0:
            negative_zero = left == 0 and type(node.left) is _ast.UnaryOp and type(node.left.op) is _ast.USub  # repr writes -0.0 as "-0"
            real = -0.0 if negative_zero else float(left)
            return complex(real, right.imag if type(node.op) is _ast.Add else -right.imag)  # signed zeros kept: (-1-0j)
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
    kind = id(type(value))
    if kind in _ATOMS:
        return True
    if depth >= MAX_DEPTH:
        return False
    if kind in _SEQUENCES:
        return all(id(type(item)) in _ATOMS or _plain(item, depth + 1) for item in value)
    if kind == id(dict):
        return all((id(type(k)) in _ATOMS or _plain(k, depth + 1)) and (id(type(v)) in _ATOMS or _plain(v, depth + 1)) for k, v in value.items())
    return False


def _node(value, depth):
    """The tagged tree of ``value``: ("=", plain value), or (tag, its parts as trees)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(value)
    if id(kind) in _ATOMS:
        return ("=", value)
    if id(kind) in _SEQUENCES or kind is dict:
        parts = [_node(item, depth + 1) for item in value] if kind is not dict else [(_node(k, depth + 1), _node(v, depth + 1)) for k, v in value.items()]
        flat = parts if kind is not dict else [node for pair in parts for node in pair]
        return ("=", value) if all(node[0] == "=" for node in flat) else (_SEQUENCES.get(id(kind), "dict"), parts)
    collections = sys.modules.get("collections")  # a value of one of its types: the program's process has it
    if getattr(value, "__dict__", None):  # attributes of its own (a Counter's most_common shadowed): not the type's behaviour
        raise TypeError("not rebuilt outside: a %s with attributes of its own" % kind.__qualname__)
    if collections is not None and (kind is collections.Counter or kind is collections.OrderedDict):  # its pairs, in order, as one tree
        return (kind.__name__, _node(list(value.items()), depth + 1))
    if collections is not None and kind is collections.defaultdict:
        return ("defaultdict", _FACTORY_NAMES[id(value.default_factory)], _node(list(value.items()), depth + 1))  # KeyError: another factory
    if collections is not None and kind is collections.deque:
        return ("deque", _node(list(value), depth + 1), value.maxlen)
    if _is_namedtuple(kind, collections):
        return ("namedtuple", kind.__name__, kind.__dict__["_fields"], _node(list(value), depth + 1))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and value.dtype.char in _NUMPY_CHARS and kind is numpy.dtype(value.dtype.char).type:
        plain = str.__str__(value) if kind is numpy.str_ else bytes(value) if kind is numpy.bytes_ else value.item()  # item(), str() drop trailing NULs
        return ("np", value.dtype.char, plain)
    raise TypeError("not rebuilt outside: " + kind.__qualname__)


# the dunder names a class collections.namedtuple or typing.NamedTuple made has in its own __dict__: any other (an __eq__,
# an __radd__, a __str__ of its own) changes how its values behave, and the class is not rebuilt
_NAMEDTUPLE_DUNDERS = frozenset({"__doc__", "__slots__", "__new__", "__repr__", "__getnewargs__", "__match_args__", "__module__",
                                 "__orig_bases__", "__annotations__", "__qualname__", "__dict__", "__weakref__", "__static_attributes__",
                                 "__firstlineno__", "__annotate_func__", "__annotations_cache__"})


_NAMEDTUPLE_REPR = []


def _is_namedtuple(kind, collections):
    """Whether ``kind`` is a class collections.namedtuple (or typing.NamedTuple) made, with its methods: tuple's
    comparisons and namedtuple's ``__repr__`` (a repr of its own, an ``__eq__`` of its own: not rebuilt)."""
    if collections is None or kind.__bases__ != (tuple,) or type(kind.__dict__.get("_fields")) is not tuple:
        return False
    if not _NAMEDTUPLE_REPR:  # the code of the __repr__ every namedtuple class gets, and the type of its fields' getters
        reference = collections.namedtuple("Reference", "a")
        _NAMEDTUPLE_REPR.extend((reference.__repr__.__code__, type(reference.__dict__["a"])))
    repr_code, getter = _NAMEDTUPLE_REPR
    fields = kind.__dict__["_fields"]
    return (getattr(kind.__dict__.get("__repr__"), "__code__", None) is repr_code and len(fields) <= MAX_FIELDS
            and all(not (name.startswith("__") and name.endswith("__")) or name in _NAMEDTUPLE_DUNDERS for name in kind.__dict__)
            and all(type(kind.__dict__.get(field)) is getter and kind.__dict__[field].__reduce__()[1][0] == index  # each field its own
                    for index, field in enumerate(fields)))


# ----------------------------------------------------------------------------------------------
# The trusted side
# ----------------------------------------------------------------------------------------------


def is_unknown(text: str) -> bool:
    """Whether :func:`wire` wrote ``text`` for a value of a type :func:`unwire` does not rebuild."""
    return text.startswith(TYPED + "('unknown',")


def unwire(text: str):
    """The value :func:`wire` wrote as ``text``, of the same type, built from plain literals only.
    Raises what :func:`literal` raises, and ValueError for a tagged tree it does not rebuild."""
    if not text.startswith(TYPED):
        return literal(text)
    tree = literal(text[len(TYPED):])
    _CLASSES.made = {}  # one class per name and fields within a value; two values never share one (a class made per call in the program)
    try:
        return _build(tree, 0)
    except (TypeError, OverflowError, KeyError, ImportError, AttributeError, ArithmeticError) as err:  # an unhashable key, an int past int8
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
    if type(name) is not str or type(fields) is not tuple or not all(type(field) is str for field in fields) or len(fields) > MAX_FIELDS:
        raise ValueError("a namedtuple comes as its name and at most %d field names" % MAX_FIELDS)
    values = _items(depth, items)
    if len(values) != len(fields):
        raise ValueError("a namedtuple of %d fields holds %d values" % (len(fields), len(values)))
    return _namedtuple_class(name, fields)(*values)


_CLASSES = _thread._local()  # .made: (name, fields) -> its namedtuple class, made once per value text (per unwire call)


def _namedtuple_class(name, fields):
    made = _CLASSES.made.get((name, fields))
    if made is None:  # namedtuple checks the name and fields: identifiers, no keyword, no leading underscore in a field, no repeat
        try:
            made = _collections().namedtuple(name, fields)
        except SyntaxError as err:  # two field names that read as one identifier once normalised ("x", "ｘ")
            raise ValueError("namedtuple field names: %s" % err) from None
        _CLASSES.made[(name, fields)] = made
    return made


def _numpy_scalar(depth, char, value):
    """The numpy scalar of type ``numpy.dtype(char).type`` holding the plain ``value`` (``item()``, ``str`` or ``bytes`` of it)."""
    if type(char) is not str or len(char) != 1 or char not in _NUMPY_CHARS:
        raise ValueError("not a numpy scalar type rebuilt here: %.40r" % (char,))
    if "numpy" not in sys.modules:  # the sandbox's checker: one thread for numpy's maths libraries
        import os  # noqa: PLC0415

        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    import numpy  # noqa: PLC0415 - only where a numpy value arrives

    dtype = numpy.dtype(char)
    if type(value) not in _KINDS[dtype.kind]:
        raise ValueError("a numpy %s cannot hold %.40r" % (dtype.type.__name__, value))
    with numpy.errstate(all="raise"):  # a float past float32's range raises (FloatingPointError): no value of the program's holds it
        return dtype.type(value)


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
    "unknown": _unknown,
}
