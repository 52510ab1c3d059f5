import glob
import os
import tempfile

import pytest

from rlalign.lm.code_execution import CodeExecutionReward, extract_code, network_isolation_available, run_program


def test_extract_code_takes_the_last_fenced_block_or_the_whole_text():
    assert extract_code("x = 1") == "x = 1"
    text = "first\n```python\na = 1\n```\nthen\n```\nb = 2\n```\n"
    assert extract_code(text) == "b = 2\n"


def test_passing_and_failing_programs():
    reward = CodeExecutionReward({"add": "assert add(2, 3) == 5"}, require_network_isolation=False)
    completions = ["def add(a, b):\n    return a + b", "```python\ndef add(a, b):\n    return a - b\n```", "def add(a, b) return"]
    assert reward(["add"] * 3, completions) == [1.0, 0.0, 0.0]


def test_unknown_prompt_is_an_error_naming_it():
    reward = CodeExecutionReward({}, require_network_isolation=False)
    with pytest.raises(KeyError, match="no tests for prompt 'nope'"):
        reward(["nope"], ["pass"])


def test_time_limit_kills_an_infinite_loop():
    code, message = run_program("while True:\n    pass", timeout_s=1.0)
    assert code is None and message == "timed out"


def test_memory_limit_stops_a_large_allocation():
    code, message = run_program("x = bytearray(4 * 1024**3)", memory_mb=256)
    assert code != 0 and "MemoryError" in message


@pytest.mark.parametrize("isolate_network", [True, False])
def test_no_network(isolate_network):
    if isolate_network and not network_isolation_available():
        pytest.skip("this machine refuses network namespaces; the audit-hook case still runs")
    # the audit hook blocks the program's own sockets
    code, message = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9), 1)\n", isolate_network=isolate_network)
    assert code != 0 and "network access is disabled" in message
    if isolate_network:
        # a grandchild interpreter escapes the audit hook but not the empty network namespace
        source = (
            "import subprocess, sys\n"
            "p = subprocess.run([sys.executable, '-c', \"import socket; socket.create_connection(('127.0.0.1', 9), 1)\"], capture_output=True)\n"
            "sys.stderr.write(p.stderr.decode())\nsys.exit(p.returncode)\n"
        )
        code, message = run_program(source)
        assert code != 0 and "unreachable" in message


def test_working_directory_is_thrown_away_and_environment_is_minimal():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlalign-exec-*")))
    source = "import os\nopen('left.txt', 'w').write('x')\nassert 'PYTHONPATH' not in os.environ and os.getcwd() == os.environ['HOME']\n"
    assert run_program(source)[0] == 0
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rlalign-exec-*"))) == before
