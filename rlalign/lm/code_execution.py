"""A code-execution reward: run each completion's program against the prompt's tests, in a sandbox.

    reward = code_execution({prompt: "assert add(2, 3) == 5"}, timeout_s=5, memory_mb=512)
    reward(prompts, completions)   # 1.0 where the program and its tests exit 0, else 0.0

The program is the last fenced code block of the completion (```python ... ``` or ``` ... ```),
or the whole completion when it has none; the prompt's test code is appended and the file runs in
a fresh interpreter. Untrusted code is confined as far as an unprivileged library can:

- its own process (``python -I``: isolated mode, no user site-packages, no PYTHON* variables),
  with a minimal environment and a throw-away working directory that is deleted afterwards;
- resource limits set in the child before it starts: address space (``memory_mb``), CPU seconds,
  file size (16 MB), open files, and a core-dump size of 0; a wall-clock ``timeout_s`` on top
  kills the whole process group;
- no network: the child is moved into a new, empty network namespace (``unshare(CLONE_NEWNET)``,
  or a user + network namespace where unprivileged user namespaces are allowed). Where neither is
  permitted, construction fails unless ``require_network_isolation=False``, in which case a Python
  audit hook (which the program cannot remove) refuses every socket operation instead.

This is a sandbox for reward computation on a research machine, not a security boundary against
a determined attacker (use containers or gVisor for that). Programs run in parallel threads, each
waiting on its own subprocess.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["extract_code", "network_isolation_available", "CodeExecutionReward", "code_execution", "run_program"]

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

# Runs first in the child: refuses any socket use at the Python level (a second line of defence;
# the network namespace is the first). Audit hooks cannot be removed once added.
_PRELUDE = """import sys as _sys
def _no_network(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in the code-execution sandbox")
_sys.addaudithook(_no_network)
del _no_network
"""


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion``, or the whole text when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child


def _unshare(flags: int) -> bool:
    return _LIBC.unshare(flags) == 0


def _isolate_network() -> bool:
    return _unshare(_CLONE_NEWNET) or _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)


def network_isolation_available() -> bool:
    """Whether a child process can be put in an empty network namespace on this machine."""
    probe = subprocess.run(
        [sys.executable, "-I", "-c", "import socket; socket.create_connection(('127.0.0.1', 9), 1)"],
        preexec_fn=_isolate_network_or_die,
        capture_output=True,
        timeout=30,
    )
    return b"Network is unreachable" in probe.stderr or b"Errno 101" in probe.stderr


def _isolate_network_or_die() -> None:
    if not _isolate_network():
        os._exit(97)


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    isolate_network: bool

    def apply(self) -> None:
        """In the child, between fork and exec."""
        os.setsid()
        mem = self.memory_mb * 2**20
        cpu = max(1, int(self.timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.isolate_network and not _isolate_network():
            os._exit(97)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512, isolate_network: bool = True) -> tuple[int | None, str]:
    """Run ``source`` in the sandbox; returns (exit code or None on time-out, the tail of stderr)."""
    workdir = tempfile.mkdtemp(prefix="rlalign-exec-")
    try:
        path = os.path.join(workdir, "program.py")
        with open(path, "w") as f:
            f.write(_PRELUDE + source)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        limits = _Limits(timeout_s, memory_mb, isolate_network)
        proc = subprocess.Popen(
            [sys.executable, "-I", "program.py"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=limits.apply,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None, "timed out"
        return proc.returncode, stderr.decode(errors="replace")[-2000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class CodeExecutionReward:
    """1.0 when the completion's program passes the prompt's tests in the sandbox, else 0.0."""

    name = "code_execution"

    def __init__(self, tests: Mapping[str, str], timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None, require_network_isolation: bool = True):
        self.tests = dict(tests)
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_workers = max_workers or max(1, os.cpu_count() or 1)
        self.isolate_network = network_isolation_available()
        if not self.isolate_network and require_network_isolation:
            raise RuntimeError(
                "code_execution: this machine does not allow a network namespace for the sandbox "
                "(unshare(CLONE_NEWNET) refused); pass require_network_isolation=False to rely on the "
                "Python-level socket block alone"
            )

    def _one(self, prompt: str, completion: str) -> float:
        if prompt not in self.tests:
            raise KeyError(f"code_execution: no tests for prompt {prompt!r}")
        source = extract_code(completion) + "\n\n" + self.tests[prompt] + "\n"
        code, _ = run_program(source, self.timeout_s, self.memory_mb, self.isolate_network)
        return 1.0 if code == 0 else 0.0

    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        with ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(self._one, prompts, completions))


def code_execution(tests: Mapping[str, str], timeout_s: float = 5.0, memory_mb: int = 512, require_network_isolation: bool = True) -> CodeExecutionReward:
    """The reward function of this module (see :class:`CodeExecutionReward`)."""
    return CodeExecutionReward(tests, timeout_s, memory_mb, require_network_isolation=require_network_isolation)
