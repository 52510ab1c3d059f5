"""Values a program returns cross the code sandbox as text and are rebuilt outside as the same types
(rlalign.lm.code_values), so a case passes where Python's own assert passes and fails where it fails:
a table of (returned value, assert) pairs scored in the asserts, HumanEval and call formats against
Python's verdict on the real value."""

import collections
import math
import typing

import numpy as np
import pytest

from rlalign.lm import sandbox
from rlalign.lm.code_execution import MAX_RESULT_ITEMS, code_execution, parse_tests
from rlalign.lm.code_formats import _call_passes, same_value
from rlalign.lm.code_values import MAX_FIELDS, TYPED, unwire, wire

needs_isolation = pytest.mark.skipif(sandbox.isolation_available() is not None, reason=f"no sandbox here: {sandbox.isolation_available()}")

Point = collections.namedtuple("Point", "x y")

# what f() returns, as a program writes it (numpy and collections imported by each program)
RETURNS = {
    "np_int": "np.int64(4)",
    "np_bool": "np.bool_(True)",
    "np_f64": "np.float64(0.1) + np.float64(0.2)",
    "np_f32": "np.float32(0.1)",
    "np_list": "[np.int64(1), np.int64(2), np.int64(3)]",
    "np_nul": "np.str_('a\\x00')",
    "np_longlong": "np.longlong(4)",
    "np_str": "np.str_('ab')",
    "np_nested": "{np.int64(1): [np.float64(0.5)]}",
    "counter": "collections.Counter('abca')",
    "ordered": "collections.OrderedDict([('b', 1), ('a', 2)])",
    "default": "collections.defaultdict(list, {'a': [1]})",
    "deque": "collections.deque([1, 2, 3])",
    "point": "collections.namedtuple('Point', 'x y')(1, 2)",
    "plain": "[1, (2, 'x'), {'k': None}]",
}
# (which f, the assert's expression): each is scored against Python's verdict on the real value
ASSERTS = [
    ("np_int", "f() == 4"), ("np_int", "type(f()) == int"), ("np_int", "isinstance(f(), int)"), ("np_int", "str(f()) == '4'"),
    ("np_int", "repr(f()) == '4'"), ("np_int", "f() + 1 == 5"), ("np_int", "f() // 3 == 1"),
    ("np_bool", "f() is True"), ("np_bool", "f() == True"), ("np_bool", "f()"), ("np_bool", "not f()"), ("np_bool", "str(f()) == 'True'"),
    ("np_f64", "f() == 0.30000000000000004"), ("np_f64", "abs(f() - 0.3) < 1e-9"), ("np_f64", "round(f(), 2) == 0.3"), ("np_f64", "type(f()) == float"),
    ("np_f32", "f() == 0.1"), ("np_f32", "abs(f() - 0.1) < 1e-6"),
    ("np_list", "f() == [1, 2, 3]"), ("np_list", "str(f()) == '[1, 2, 3]'"), ("np_list", "sum(f()) == 6"),
    ("np_nul", "f() == 'a'"), ("np_nul", "len(f()) == 2"), ("np_nul", "str(f()) == 'a'"), ("np_longlong", "f() == 4"),
    ("np_str", "f() == 'ab'"), ("np_str", "type(f()) == str"), ("np_str", "f() + 'c' == 'abc'"),
    ("np_nested", "f() == {1: [0.5]}"), ("np_nested", "str(f()) == '{1: [0.5]}'"),
    ("counter", "f() == {'a': 2, 'b': 1, 'c': 1}"), ("counter", "str(f()) == \"Counter({'a': 2, 'b': 1, 'c': 1})\""), ("counter", "f()['z'] == 0"),
    ("counter", "f().most_common(1) == [('a', 2)]"), ("counter", "type(f()) == dict"), ("counter", "isinstance(f(), dict)"),
    ("ordered", "list(f()) == ['b', 'a']"), ("ordered", "list(f()) == ['a', 'b']"), ("ordered", "f() == {'a': 2, 'b': 1}"),
    ("ordered", "str(f()) == str(dict(f()))"),
    ("default", "f()['x'] == []"), ("default", "f() == {'a': [1]}"), ("default", "len(f()) == 1"),
    ("deque", "list(f()) == [1, 2, 3]"), ("deque", "f() == [1, 2, 3]"), ("deque", "len(f()) == 3"),
    ("point", "f() == (1, 2)"), ("point", "f()[0] == 1"), ("point", "str(f()) == 'Point(x=1, y=2)'"), ("point", "f().x == 1"),
    ("point", "type(f()) == tuple"), ("point", "isinstance(f(), tuple)"), ("point", "type(f()) == type(f())"),
    ("plain", "f() == [1, (2, 'x'), {'k': None}]"), ("plain", "f() == [1, [2, 'x'], {'k': None}]"),
]
# (which f, the expected value of a call-format row, as JSON gives it)
CALLS = [("np_int", 4), ("np_int", 5), ("np_bool", True), ("np_f32", 0.1), ("np_list", [1, 2, 3]), ("np_nul", "a"),
         ("counter", {"a": 2, "b": 1, "c": 1}), ("point", [1, 2]), ("deque", [1, 2, 3]), ("np_f64", 0.30000000000000004), ("plain", [1, [2, "x"], {"k": None}])]


def program(name: str) -> str:
    return f"import collections\nimport numpy as np\n\ndef f():\n    return {RETURNS[name]}\n"


def python_verdict(name: str, expression: str) -> bool:
    """Whether Python's own ``assert <expression>`` passes on the program's real value."""
    scope: dict = {}
    exec(program(name), scope)  # noqa: S102 - the test's own programs
    try:
        return bool(eval(expression, scope))  # noqa: S307
    except Exception:  # e.g. the truth value of an array
        return False


def test_the_table_holds_both_verdicts_and_the_plain_form_alone_would_get_them_wrong():
    verdicts = [python_verdict(name, expression) for name, expression in ASSERTS]
    assert 20 < sum(verdicts) < len(verdicts) - 10  # passes and failures both
    # the plain form of these values (np.True_ -> True, a Counter -> a dict, a namedtuple -> a tuple) passes some asserts Python fails
    plain = {"np_bool": True, "counter": {"a": 2, "b": 1, "c": 1}, "point": (1, 2), "np_f32": 0.10000000149011612}

    def plain_verdict(name, expression):
        try:
            return bool(eval(expression, {"f": lambda: plain[name]}))  # noqa: S307
        except Exception:
            return False

    flipped = [(name, e) for name, e in ASSERTS if name in plain and plain_verdict(name, e) and not python_verdict(name, e)]
    assert ("np_bool", "f() is True") in flipped and ("counter", "type(f()) == dict") in flipped and ("point", "type(f()) == tuple") in flipped


@pytest.mark.parametrize("name", sorted(RETURNS))
def test_each_value_crosses_as_its_own_type_and_repr(name):
    scope: dict = {}
    exec(program(name), scope)  # noqa: S102
    value = scope["f"]()
    text = wire(value)
    assert text.startswith(TYPED) == (name != "plain")
    back = unwire(text)
    assert type(back).__name__ == type(value).__name__ and repr(back) == repr(value)
    assert back == value and (not isinstance(value, str) or len(back) == len(value))


def test_numpy_scalars_of_each_type_cross_whole():
    values = [np.int8(-3), np.uint64(2**64 - 1), np.float16(0.1), np.complex64(1 - 2j), np.bytes_(b"x\x00"), np.float64(math.inf),
              np.float32(-0.0), np.intc(7), np.longlong(8), np.ulonglong(9), np.str_("")]
    for value in values:
        back = unwire(wire(value))
        assert type(back) is type(value) and back.dtype == value.dtype and repr(back) == repr(value) and str(back) == str(value)
    nan = unwire(wire(np.float32("nan")))
    assert type(nan) is np.float32 and math.isnan(nan)


def test_a_type_not_rebuilt_here_fails_even_where_its_repr_reads_as_a_plain_value():
    class Id(int):
        pass

    class Odd(np.int64):  # a subclass of a type rebuilt here, with an __eq__ of its own
        def __eq__(self, other):
            return False

    class Shown(typing.NamedTuple):
        x: int

        def __repr__(self):
            return "P(x=1)"

    class Added(typing.NamedTuple):
        x: int

        def __radd__(self, other):
            return 0

    Swapped = collections.namedtuple("Swapped", "x y")
    Swapped._fields = ("y", "x")  # its repr still writes x first
    Shadowed = type("Shadowed", (collections.namedtuple("Shadowed", "x"),), {})  # a subclass
    Shadowed.__bases__[0].x = property(lambda self: 5)  # a field's getter replaced
    shadowed_base = Shadowed.__bases__[0]
    counter = collections.Counter("ab")
    counter.most_common = lambda n=None: []

    class Meta(type):
        def __eq__(cls, other):
            return True

        __hash__ = type.__hash__

    posing = Meta("Counter", (collections.Counter,), {})  # equal to every class, Counter included
    disguised = type("Counter", (collections.Counter,), {"__module__": "collections", "__eq__": lambda self, other: True})
    assert repr(Id(3)) == "3"  # read as a plain int, `type(f()) is int` would pass where Python fails it
    for value in (Id(3), [Id(3)], Odd(4), Shown(1), Added(1), Swapped(1, 2), shadowed_base(1), counter, posing("ab"), disguised("ab"),
                  collections.defaultdict(lambda: 0), [np.datetime64("2026-01-01")],
                  np.array([1, 2]), np.zeros((10**9, 0)), {"k": range(3)}, np.longdouble(1)):
        with pytest.raises(ValueError, match="not rebuilt here"):
            unwire(wire(value))


@pytest.mark.parametrize("forged", [
    "('np', 'O', 1)", "('np', 'M', 1)", "('np', 'g', 1.0)", "('np', 'l', 'a')", "('np', 'b', 1000)", "('np', '?', 1)", "('np', 'f', 1e300)",
    "('np', '<i8', 1)", "('np', 'U', b'a')", "('ndarray', '<i8', (0, 10**18), [])", "('namedtuple', 'P', ('x', 'ｘ'), ('=', [1, 2]))",
    "('namedtuple', 'P', tuple('a%d' % i for i in range(300)), ('=', []))", "('namedtuple', 'P', ('__class__',), ('=', [1]))", "('namedtuple', 'P', ('a b',), ('=', [1]))",
    "('namedtuple', 'P', ('x', 'x'), ('=', [1, 2]))", "('namedtuple', 'class', ('x',), ('=', [1]))", "('namedtuple', 'P', ('x',), ('=', [1, 2]))",
    "('defaultdict', 'os.system', ('=', []))", "('deque', ('=', [1]), -1)", "('Counter', ('=', [1, 2]))", "('dict', [(('=', []), ('=', 1))])",
    "('eval', '1')", "['=', 1]", "('=',)", "('=', 1, 2)", "1",
])
def test_a_forged_tagged_value_is_refused_with_a_value_error(forged):
    with pytest.raises(ValueError):
        unwire(TYPED + forged)


def test_a_namedtuple_has_at_most_max_fields_fields():
    fields = tuple(f"a{i}" for i in range(MAX_FIELDS))
    assert unwire(TYPED + repr(("namedtuple", "P", fields, ("=", list(range(MAX_FIELDS))))))._fields == fields
    with pytest.raises(ValueError, match="at most 255 field names"):
        unwire(TYPED + repr(("namedtuple", "P", (*fields, "z"), ("=", list(range(MAX_FIELDS + 1))))))


def test_a_numpy_count_cannot_grow_a_sequence_past_the_bound_in_a_check():
    _, cases = parse_tests("assert len([0] * f()) == 3\nassert len('ab' * f()) == 6\nassert len(f() * [0]) == 3")
    assert all(case.passes([np.int64(3)]) for case in cases)
    assert not any(case.passes([np.int64(MAX_RESULT_ITEMS)]) for case in cases)  # refused before a list of 4 million (Python would build it)
    _, [repeated] = parse_tests("assert len(f() * g()) == 6")  # a deque repeats as a list does
    assert repeated.passes([collections.deque([1, 2]), np.int64(3)]) and not repeated.passes([collections.deque([1, 2]), np.int64(MAX_RESULT_ITEMS)])


def test_returned_values_compare_as_the_call_format_compares_them_on_the_real_value():
    for name, expected in CALLS:
        scope: dict = {}
        exec(program(name), scope)  # noqa: S102
        try:
            real = bool(same_value(scope["f"](), expected))
        except Exception:
            real = False
        assert _call_passes(wire(scope["f"]()), expected) == real, (name, expected)


@needs_isolation
def test_asserts_humaneval_and_call_formats_give_pythons_verdict_on_the_real_value():
    reward = code_execution(partial_credit=True)
    verdicts = [python_verdict(name, expression) for name, expression in ASSERTS]
    loadable = []
    for index, (name, expression) in enumerate(ASSERTS):
        try:
            parse_tests(f"assert {expression}")
            loadable.append(index)
        except Exception:  # a method or attribute of the value (f().x): computed next to the program, refused at load
            assert "f()." in expression
    asserts = reward(["p"] * len(loadable), [program(ASSERTS[i][0]) for i in loadable], tests=[f"assert {ASSERTS[i][1]}" for i in loadable])
    assert asserts == [float(verdicts[i]) for i in loadable], [(ASSERTS[i], verdicts[i]) for i, s in zip(loadable, asserts) if s != verdicts[i]]
    checks = [f"def check(candidate):\n    assert {expression.replace('f()', 'candidate()')}\n" for _, expression in ASSERTS]
    humaneval = reward(["p"] * len(ASSERTS), [program(name) for name, _ in ASSERTS], test=checks, entry_point=["f"] * len(ASSERTS))
    assert humaneval == [float(v) for v in verdicts], [(a, v) for a, v, s in zip(ASSERTS, verdicts, humaneval) if s != v]
    rows = [{"fn_name": "f", "inputs": [[]], "outputs": [expected]} for _, expected in CALLS]
    calls = reward(["p"] * len(CALLS), [program(name) for name, _ in CALLS], input_output=rows)
    expected_calls = []
    for name, expected in CALLS:
        scope: dict = {}
        exec(program(name), scope)  # noqa: S102
        try:
            expected_calls.append(float(bool(same_value(scope["f"](), expected))))
        except Exception:
            expected_calls.append(0.0)
    assert calls == expected_calls and 0 < sum(expected_calls) < len(CALLS)


@needs_isolation
def test_a_value_the_check_passes_back_to_the_program_crosses_both_ways():
    check = "def check(candidate):\n    assert candidate(candidate(np.int64(2))) == 8\n    assert type(candidate(np.int64(2))) is np.int64\n"
    rows = {"p": {"test": "import numpy as np\n" + check, "entry_point": "f"}}
    doubles = "import numpy as np\ndef f(x):\n    assert type(x) is np.int64\n    return x * 2\n"
    assert code_execution(rows, partial_credit=True)(["p", "p"], [doubles, "def f(x):\n    return int(x) * 2\n"]) == [1.0, 0.5]


@needs_isolation
def test_a_check_that_expects_an_exception_is_not_passed_by_a_value_not_rebuilt_here():
    # the value's refusal is not the program's ValueError: a check catching ValueError (or Exception) does not see it
    check = ("def check(candidate):\n    try:\n        candidate(-1)\n        assert False\n    except ValueError:\n        pass\n"
             "    try:\n        candidate(-2)\n        assert False\n    except Exception:\n        pass\n")
    rows = {"p": {"test": check, "entry_point": "f"}}
    programs = ["def f(x):\n    raise ValueError('negative')\n", "from decimal import Decimal\ndef f(x):\n    return Decimal(1)\n",
                "import numpy as np\ndef f(x):\n    return np.array([x])\n"]
    assert code_execution(rows, partial_credit=True)(["p"] * 3, programs) == [1.0, 0.0, 0.0]


def test_long_numeric_texts_read_by_json_are_the_values_python_reads():
    import ast
    import json
    import random

    from rlalign.lm import code_values
    from rlalign.lm.code_values import NUMERIC_FAST, literal

    rng = random.Random(0)

    def number(odd):
        plain = [str(rng.randint(-10**30, 10**30)), repr(rng.uniform(-1e6, 1e6)), repr(rng.choice([1e300, -0.0, 5e-324, 2.5e-8])), "-0", "1E5", "3e+20"]
        return rng.choice(plain + (["00", "- 1", ".5", "5.", "+1"] if odd else []))

    def value(depth, odd):
        if depth > 3 or rng.random() < 0.3:
            return number(odd)
        items = [value(depth + 1, odd) for _ in range(rng.randint(0, 6))]
        return "[" + ", ".join(items) + ("," if odd and items and rng.random() < 0.1 else "") + "]"

    read = []
    real_loads = json.loads
    with pytest.MonkeyPatch.context() as patch:  # count the texts json read: the fast path is taken, not only correct
        patch.setattr(json, "loads", lambda text: (real_loads(text), read.append(text))[0])  # the texts json parsed
        for _ in range(300):
            odd = rng.random() < 0.5  # with tokens only Python reads (a trailing comma, "- 1", ".5", "5.", "+1", "00")
            text = "[" + ", ".join(value(0, odd) for _ in range(40)) + "]"
            assert len(text) >= NUMERIC_FAST and code_values._NUMERIC.issuperset(text)
            got, want = literal(text), ast.literal_eval(text)
            assert repr(got) == repr(want)  # the same numbers of the same types (-0.0, ints past 2**53), nested alike
    assert 100 < len(read) < 200  # the texts without Python's own tokens (about half)
    assert literal("[" + "1, " * 200 + "]") == [1] * 200  # a trailing comma: parsed as Python


def test_a_mib_of_numbers_is_read_without_a_syntax_tree():
    import tracemalloc

    from rlalign.lm.code_values import literal

    text = repr([(-1) ** i * (i % 1000) for i in range(200_000)])  # ~1.2 MB: the largest an assert may report is 1 MiB
    tracemalloc.start()
    try:
        value = literal(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert value[:4] == [0, -1, 2, -3] and len(value) == 200_000
    assert peak < 16 << 20  # the list itself (~2 MB); a syntax tree of it took ~0.2 GB a MiB of text


def test_a_set_or_dict_of_keys_whose_hashes_collide_is_refused_and_honest_ones_are_read():
    # ints 2**61 - 1 apart hash alike: 20,000 of them as a set took the trainer 2 s to build (growing with the square), every case
    from rlalign.lm.code_execution import _passes
    from rlalign.lm.code_values import MAX_COLLISIONS, literal

    colliding = [i * (2**61 - 1) for i in range(1, 3 * MAX_COLLISIONS)]
    for text in (repr(set(colliding)), repr(dict.fromkeys(colliding, 0)), repr(collections.Counter(colliding))):
        with pytest.raises(ValueError, match="keys' hashes collide"):
            literal(text.removeprefix("Counter(").removesuffix(")"))
    _, [case] = parse_tests("assert f() == {1, 2}")
    assert not _passes(case, repr([repr(set(colliding))]))  # the case fails; the reward goes on
    honest = set(range(-3, 3 * MAX_COLLISIONS)) | {-1, -2}  # -1 and -2 hash alike: a few such keys are nothing
    assert literal(repr(honest)) == honest and literal(repr(dict.fromkeys(honest, 1))) == dict.fromkeys(honest, 1)
    assert literal("{1: 'a', 1: 'b'}") == {1: "b"}  # a key given twice keeps its last value, as Python's dict display


def test_nesting_crosses_to_the_depth_the_parse_allows_and_the_json_path_agrees():
    from rlalign.lm.code_values import MAX_DEPTH, literal

    def nested(depth, inner):
        for _ in range(depth - 1):
            inner = [inner]
        return inner

    assert unwire(wire(nested(MAX_DEPTH, []))) == nested(MAX_DEPTH, [])  # plain: as deep as Python's parser takes
    typed = nested(90, [np.int64(1)])  # a tagged tree nests two levels a list: ("list", [...])
    assert unwire(wire(typed)) == typed
    with pytest.raises(ValueError, match="not rebuilt here"):
        unwire(wire(nested(MAX_DEPTH + 5, [])))  # past MAX_DEPTH: a note, not a value
    for depth in (MAX_DEPTH, MAX_DEPTH + 1, MAX_DEPTH + 2, 5000):  # padded past NUMERIC_FAST: json's length, Python's depth rule
        text = "[" * depth + "]" * depth + " " * 300
        try:
            accepted = literal(text) is not None
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            accepted = False
        assert accepted == (depth <= MAX_DEPTH), depth  # Python's parser takes 200 nested brackets: json is held to it


def test_complex_numbers_keep_their_signed_zeros():
    from rlalign.lm.code_values import literal

    for value in (complex(-1.0, -0.0), complex(0.0, -2.0), complex(-0.0, -0.0), complex(-0.0, 1.0), complex(1.0, -0.0), 1j, -1j, complex(2.5, 3)):
        back = literal(repr(value))
        assert repr(back) == repr(value) and math.copysign(1, back.real) == math.copysign(1, value.real), value


def test_any_text_that_is_no_value_fails_its_case_and_never_stops_the_reward():
    from rlalign.lm.code_execution import _passes

    _, [case] = parse_tests("assert f(1) == 1")
    for text in ("1" + "0" * 400 + "+1j", "[" * 300 + "]" * 300, TYPED + "('np', 'f', 1e300)", "\x00", TYPED + "1"):
        assert not _passes(case, repr([text]))  # OverflowError (a complex past float), RecursionError...: the case fails


@needs_isolation
def test_a_program_that_writes_its_own_answers_or_gets_an_argument_it_cannot_be_sent_fails():
    # the program replaces the harness's encoder with one writing a text no parse takes (an int too large for a complex);
    # a check that expects an exception must not take the refusal for the program's own
    forger = "import sys\nsys.modules['__main__'].wire = lambda value: '1' + '0' * 400 + '+1j'\ndef f(x):\n    return x\n"
    expects_error = "def check(candidate):\n    try:\n        candidate(-1)\n    except Exception:\n        pass\n    else:\n        assert False\n"
    sends_fraction = ("from fractions import Fraction\ndef check(candidate):\n    raised = False\n    try:\n        candidate(Fraction(1, 3))\n"
                      "    except Exception:\n        raised = True\n    assert raised\n")
    rows = {"asserts": "assert f(1) == 1", "expects": {"test": expects_error, "entry_point": "f"}, "fraction": {"test": sends_fraction, "entry_point": "f"}}
    reward = code_execution(rows)
    assert reward(["asserts", "expects", "fraction"], [forger, forger, "def f(x):\n    return 0\n"]) == [0.0, 0.0, 0.0]
    assert reward(["asserts", "expects"], ["def f(x):\n    return x\n", "def f(x):\n    raise ValueError(x)\n"]) == [1.0, 1.0]


def test_edges_of_what_crosses():
    from rlalign.lm.code_values import literal

    assert type(literal("set([1])")) is set and type(literal("frozenset({1})")) is frozenset
    for text in ("1+0", "1+2", "'a'+1j", "(1+2j)+3j"):  # only a real plus an imaginary literal is a complex number
        with pytest.raises(ValueError):
            literal(text)
    wide = collections.namedtuple("Wide", [f"f{i}" for i in range(MAX_FIELDS)])  # at the bound: crosses
    assert unwire(wire(wide(*range(MAX_FIELDS)))) == tuple(range(MAX_FIELDS))
    assert wire(collections.namedtuple("Wider", [f"f{i}" for i in range(MAX_FIELDS + 1)])(*range(MAX_FIELDS + 1))).startswith(TYPED + "('unknown',")
    bounded = unwire(wire(collections.deque([np.int64(1), 2], maxlen=3)))
    assert type(bounded) is collections.deque and bounded.maxlen == 3 and list(bounded) == [1, 2]
    no_factory = collections.defaultdict(None, {"a": np.int64(1)})
    back = unwire(wire(no_factory))
    assert type(back) is collections.defaultdict and back.default_factory is None and back == no_factory

    class Id(int):
        pass

    assert wire(Id(3)) == TYPED + repr(("unknown", "not rebuilt outside: " + Id.__qualname__))
    deep_dicts: dict = {}
    for _ in range(150):  # dicts nested 150 deep are plain, and cross as their repr
        deep_dicts = {"k": deep_dicts}
    assert not wire(deep_dicts).startswith(TYPED) and unwire(wire(deep_dicts)) == deep_dicts
