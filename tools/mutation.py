#!/usr/bin/env python
"""Mutation testing of rlalign with cosmic-ray (a developer tool, not run in CI).

    .venv/bin/pip install -e '.[mutation]'        # once: cosmic-ray
    .venv/bin/python tools/mutation.py              # default sample: 170 mutants, seed 0, 1 worker
    .venv/bin/python tools/mutation.py --sample 40 --seed 3 --paths rlalign/core
    .venv/bin/python tools/mutation.py --ids 'rlalign/core/kl.py:NumberReplacer:1a2b3c4d'
    .venv/bin/python tools/mutation.py --list       # population and sample, nothing run

It copies the working tree (tracked and untracked-but-not-ignored files) into a private temporary
folder, enumerates cosmic-ray's mutants of the six targets in tools/mutation.toml, draws a seeded
sample stratified over the targets, runs the unmutated tests of the sampled modules once (the
baseline: per-test times for the timeouts, and tests that already fail are left out), then, for
each mutant, has cosmic-ray write it into the copy and run the module's tests with ``pytest -x``
under a timeout, and restores the file. The working tree is never written to. Mutants listed in
tools/mutation_equivalent.txt are excluded from the score. Results: printed, and written to
``runs/mutation/mutation.json`` and ``runs/mutation/mutation.md`` (``--out``). See tools/README.md.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import difflib
import fnmatch
import hashlib
import json
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import cosmic_ray.commands
    import cosmic_ray.mutating
    import cosmic_ray.plugins
    import cosmic_ray.testing
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("tools/mutation.py needs cosmic-ray: .venv/bin/pip install -e '.[mutation]'")

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
EXCLUDED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "runs", "outputs", "build", "dist", "mutants"}


# ----------------------------------------------------------------------------------------------
# Mutants
# ----------------------------------------------------------------------------------------------


@dataclass
class Mutant:
    id: str
    target: str
    path: str  # relative to the repository root
    operator: str  # cosmic-ray operator name, e.g. core/NumberReplacer
    occurrence: int
    start: tuple[int, int]  # (line 1-based, column 0-based), as cosmic-ray gives them
    end: tuple[int, int]
    definition: str | None
    line_text: str
    original: str = ""  # the mutated line(s) before and after, one line each
    mutated: str = ""
    diff: str = ""
    status: str = "pending"  # killed | timeout | survived | equivalent | error
    reason: str = ""  # killing test, equivalence reason, error text
    seconds: float = 0.0
    timeout_s: float = 0.0
    tests: list[str] = field(default_factory=list)

    @property
    def line(self) -> int:
        return self.start[0]

    @property
    def in_config_field(self) -> bool:
        """A default or bound of a pydantic config field: only a test that pins the recipe kills it."""
        return "Field(" in self.line_text

    def one_line(self) -> str:
        return f"{self.path}:{self.line}  {self.original}  ->  {self.mutated}"


def short_operator(name: str) -> str:
    return name.split("/", 1)[-1]


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, in characters, of every type annotation: mutants there change nothing at
    run time (every target module has ``from __future__ import annotations``)."""
    lines = source.splitlines()

    def char_col(line: int, col: int) -> int:  # ast gives UTF-8 byte offsets, cosmic-ray characters
        text = lines[line - 1] if line - 1 < len(lines) else ""
        return len(text.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    spans = []
    for node in ast.walk(ast.parse(source)):
        annotations = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for a in annotations:
            spans.append(((a.lineno, char_col(a.lineno, a.col_offset)), (a.end_lineno, char_col(a.end_lineno, a.end_col_offset))))
    return spans


def enumerate_mutants(root: Path, files: list[str], targets: dict[str, list[str]], operators: dict, workdir: Path) -> list[Mutant]:
    """Every cosmic-ray mutant of ``files`` (relative to ``root``) with an included operator,
    outside type annotations and lines marked ``# pragma: no mutate``, one per position for the
    operators in ``one_per_position`` (the variant with the smaller id), each with a stable id:
    ``path:operator:hash`` where the hash covers the operator, the text of the line and of the
    mutated node, and the rank among mutants with that same text, but not the line number, so an
    id survives edits elsewhere in the file and goes stale when its line changes."""
    def included(op: str) -> bool:
        return any(re.fullmatch(pattern, op) for pattern in operators["include"])

    session = workdir / "session.sqlite"
    with use_db(str(session)) as db:
        cosmic_ray.commands.init([root / f for f in files], db, {})
        items = list(db.work_items)
    session.unlink(missing_ok=True)

    sources = {f: (root / f).read_text(encoding="utf-8") for f in files}
    spans = {f: annotation_spans(s) for f, s in sources.items()}
    mutants: list[Mutant] = []
    ranks: dict[tuple, int] = {}
    specs = sorted((m for item in items for m in item.mutations), key=lambda m: (str(m.module_path), m.operator_name, m.occurrence))
    for spec in specs:
        rel = Path(spec.module_path).resolve().relative_to(root.resolve()).as_posix()
        if not included(spec.operator_name):
            continue
        start, end = tuple(spec.start_pos), tuple(spec.end_pos)
        if any(s <= start < e for s, e in spans[rel]):
            continue
        lines = sources[rel].splitlines()
        line_text = lines[start[0] - 1] if start[0] - 1 < len(lines) else ""
        if "pragma: no mutate" in line_text:
            continue
        if start[0] == end[0]:
            node_text = line_text[start[1] : end[1]]
        else:
            node_text = "\n".join([line_text[start[1] :], *lines[start[0] : end[0] - 1]])
        key = (rel, spec.operator_name, line_text.strip(), node_text)
        rank = ranks.get(key, 0)
        ranks[key] = rank + 1
        digest = hashlib.sha1(repr((spec.operator_name, line_text.strip(), node_text, rank)).encode()).hexdigest()[:8]
        target = next((name for name, paths in targets.items() if any(_under(rel, p) for p in paths)), "?")
        mutants.append(
            Mutant(
                id=f"{rel}:{short_operator(spec.operator_name)}:{digest}",
                target=target,
                path=rel,
                operator=spec.operator_name,
                occurrence=spec.occurrence,
                start=start,
                end=end,
                definition=spec.definition_name,
                line_text=line_text,
            )
        )
    single = [m for m in mutants if any(re.fullmatch(p, m.operator) for p in operators.get("one_per_position", []))]
    keep: dict[tuple, Mutant] = {}
    for m in single:
        key = (m.path, m.operator, m.start, m.end)
        if key not in keep or m.id < keep[key].id:
            keep[key] = m
    dropped = {id(m) for m in single} - {id(m) for m in keep.values()}
    return [m for m in mutants if id(m) not in dropped]


def _under(rel: str, path: str) -> bool:
    path = path.rstrip("/")
    return rel == path or rel.startswith(path + "/")


def describe(mutant: Mutant, source: str) -> bool:
    """Fill in the diff and the one-line original -> mutated of ``mutant`` (nothing is run). False
    (and status "error") when cosmic-ray's change is not a valid mutant: no change, or code that
    does not compile (cosmic-ray 8.7 takes the ``**`` of ``{**d}`` for a power and makes ``{*d}``)."""
    mutated = cosmic_ray.mutating.mutate_code(source, cosmic_ray.plugins.get_operator(mutant.operator)(), mutant.occurrence)
    if mutated is None or mutated == source:
        mutant.status, mutant.reason = "error", "cosmic-ray made no change at this occurrence"
        return False
    try:
        compile(mutated, mutant.path, "exec")
    except SyntaxError as e:
        mutant.status, mutant.reason = "error", f"cosmic-ray made code that does not compile: {e.msg} (line {e.lineno})"
        return False
    before, after = source.splitlines(), mutated.splitlines()
    mutant.diff = "".join(difflib.unified_diff([l + "\n" for l in before], [l + "\n" for l in after], f"a/{mutant.path}", f"b/{mutant.path}", n=1))
    removed = [l[1:].strip() for l in mutant.diff.splitlines() if l.startswith("-") and not l.startswith("---") and l[1:].strip()]
    added = [l[1:].strip() for l in mutant.diff.splitlines() if l.startswith("+") and not l.startswith("+++") and l[1:].strip()]
    mutant.original = " / ".join(removed) or "(nothing)"
    mutant.mutated = " / ".join(added) or "(line removed)"
    return True


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def allocate(counts: dict[str, int], n: int, minimum: int) -> dict[str, int]:
    """Mutants per target: proportional to the target's count (largest remainder), at least
    ``minimum`` (or all it has), summing to ``n`` (or to everything when there are fewer)."""
    total = sum(counts.values())
    if n >= total:
        return dict(counts)
    minimum = min(minimum, n // len(counts))  # a small sample cannot give every target the minimum
    ideal = {t: n * c / total for t, c in counts.items()}
    quota = {t: min(c, max(minimum, math.floor(ideal[t]))) for t, c in counts.items()}
    while sum(quota.values()) < n:
        t = max((t for t in counts if quota[t] < counts[t]), key=lambda t: ideal[t] - quota[t])
        quota[t] += 1
    while sum(quota.values()) > n:
        t = min((t for t in counts if quota[t] > min(minimum, counts[t])), key=lambda t: ideal[t] - quota[t])
        quota[t] -= 1
    return quota


def draw(mutants: list[Mutant], targets: list[str], n: int, seed: int, minimum: int, valid) -> tuple[list[Mutant], list[Mutant]]:
    """The stratified sample (``allocate``), drawn per target with its own seeded generator. A drawn
    mutant that ``valid`` rejects is replaced by a further draw from the same target; returns the
    sample and the rejected mutants."""
    by_target = {t: [m for m in mutants if m.target == t] for t in targets}
    by_target = {t: ms for t, ms in by_target.items() if ms}
    quota = allocate({t: len(ms) for t, ms in by_target.items()}, n, minimum)
    sample, rejected = [], []
    for t, ms in by_target.items():
        rng = random.Random(f"rlalign-mutation/{seed}/{t}")
        chosen = rng.sample(ms, quota[t])
        taken = {m.id for m in chosen}
        rest = [m for m in ms if m.id not in taken]
        good = [m for m in chosen if valid(m)]
        kept = {m.id for m in good}
        rejected += [m for m in chosen if m.id not in kept]
        while len(good) < quota[t] and rest:
            m = rest.pop(rng.randrange(len(rest)))
            (good if valid(m) else rejected).append(m)
        sample += good
    order = lambda m: (targets.index(m.target), m.path, m.start, m.operator, m.occurrence)  # noqa: E731
    return sorted(sample, key=order), rejected


# ----------------------------------------------------------------------------------------------
# Test selection
# ----------------------------------------------------------------------------------------------


class TestSelector:
    """Which test files (in order) and deselected node ids a module's mutants run."""

    def __init__(self, root: Path, config: dict):
        self.root = root
        self.rules: dict[str, list[str]] = config.get("tests", {})
        self.slow: dict[str, list[str]] = config.get("slow_tests", {})
        self.test_files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
        self._imports = {f: _imported_modules(root / f) for f in self.test_files}
        self.broken: set[str] = set()  # files whose collection fails unmutated
        self.failing: set[str] = set()  # node ids that fail unmutated

    def _expand(self, pattern: str) -> list[str]:
        p = self.root / pattern
        if any(c in pattern for c in "*?["):
            return [f for f in self.test_files if fnmatch.fnmatch(f, pattern)]
        if p.is_dir():
            return [f for f in self.test_files if f.startswith(pattern.rstrip("/") + "/")]
        return [pattern] if pattern in self.test_files else []

    def select(self, module: str) -> tuple[list[str], list[str]]:
        stem = Path(module).stem
        name = module[: -len(".py")].replace("/", ".")
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        files: list[str] = []
        for pattern, entries in self.rules.items():
            if fnmatch.fnmatch(module, pattern):
                for entry in entries:
                    files += self._expand(entry.replace("{stem}", stem))
                break
        files += [f for f in self.test_files if name in self._imports[f]]
        deselect = []
        for slow, allowed in self.slow.items():
            if module in allowed:
                continue
            if "::" in slow:
                deselect.append(slow)
            else:
                files = [f for f in files if f != slow]
        files = [f for f in dict.fromkeys(files) if f not in self.broken]
        deselect = [d for d in deselect if d.split("::")[0] in files]
        deselect += sorted(n for n in self.failing if n.split("::")[0] in files)
        return files, deselect


def _imported_modules(path: Path) -> set[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def snapshot(dest: Path) -> int:
    """Copy the working tree into ``dest``: the files git tracks plus the untracked ones it does
    not ignore (so tests being written right now are included), or, without git, everything but
    the usual build and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(REPO):
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(dirpath, f), REPO) for f in filenames if not f.endswith(".pyc")]
    copied = 0
    for f in files:
        if f.split("/", 1)[0] in EXCLUDED_DIRS:
            continue
        src, dst = REPO / f, dest / f
        if not src.is_file():  # deleted but still tracked, or being rewritten by someone right now
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        copied += 1
    return copied


def pytest_command(copy: Path, files: list[str], deselect: list[str], log: Path, extra: list[str], stop_first: bool) -> str:
    """A shell command (as cosmic-ray wants it: one string) that runs pytest in the copy with the
    copy first on the import path, so the copy's rlalign, not the working tree's, is tested, also in
    the subprocesses tests start (torchrun, python -c)."""
    args = [sys.executable, "-m", "pytest", *extra, "-p", "mutation_plugin", f"--mutation-log={log}"]
    if stop_first:
        args.append("-x")
    args += [f"--deselect={d}" for d in deselect]
    args += files
    pythonpath = os.pathsep.join([str(copy), str(TOOLS)])
    script = f"cd {shlex.quote(str(copy))} && exec env PYTHONPATH={shlex.quote(pythonpath)} OMP_NUM_THREADS=1 " + " ".join(shlex.quote(a) for a in args)
    return f"/bin/sh -c {shlex.quote(script)}"


def reap(copy: Path) -> list[int]:
    """SIGKILL what is left of a test run in ``copy``: processes whose command line or environment
    names the copy (so only this tool's, and only this worker's). cosmic-ray kills the test
    command's process group on a timeout, but torchrun starts its workers in sessions of their
    own, and a mutant that deadlocks them would leave them running. Linux only (/proc)."""
    mark = re.compile(re.escape(str(copy).encode()) + rb"(?=[/:\0]|$)")
    killed = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        try:
            if mark.search((proc / "cmdline").read_bytes()) or mark.search((proc / "environ").read_bytes()):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (OSError, ProcessLookupError):
            continue
    return killed


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass
class Baseline:
    seconds: float = 0.0
    overhead: float = 0.0
    file_seconds: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    rlalign: str | None = None


def run_baseline(copy: Path, files: list[str], deselect: list[str], extra: list[str], workdir: Path) -> Baseline:
    log = workdir / "baseline.jsonl"
    start = time.monotonic()
    outcome, output = cosmic_ray.testing.run_tests(pytest_command(copy, files, deselect, log, extra, stop_first=False), 3600)
    reap(copy)
    base = Baseline(seconds=time.monotonic() - start)
    records = read_log(log)
    if output == "timeout":
        sys.exit("the unmutated tests ran past an hour; is something hanging?")
    for r in records:
        if "rlalign" in r:
            base.rlalign = r["rlalign"]
        elif r["outcome"] == "failed":
            (base.broken if r["when"] == "collect" else base.failing).append(r["nodeid"])
        if "duration" in r and "::" in r.get("nodeid", ""):
            f = r["nodeid"].split("::")[0]
            base.file_seconds[f] = base.file_seconds.get(f, 0.0) + r["duration"]
    base.failing = sorted(set(base.failing))
    base.broken = sorted(set(base.broken))
    base.overhead = max(0.0, base.seconds - sum(base.file_seconds.values()))
    if base.rlalign is None or not Path(base.rlalign).resolve().is_relative_to(copy.resolve()):
        sys.exit(f"the baseline imported rlalign from {base.rlalign}, not from the private copy {copy}:\n{output[-3000:]}")
    return base


def run_mutant(mutant: Mutant, copy: Path, files: list[str], deselect: list[str], timeout: float, extra: list[str], log: Path) -> None:
    mutant.tests, mutant.timeout_s = files, round(timeout, 1)
    if not files:
        mutant.status, mutant.reason = "survived", "no test selected for this module"
        return
    spec = MutationSpec(copy / mutant.path, mutant.operator, mutant.occurrence, mutant.start, mutant.end)
    start = time.monotonic()
    result = cosmic_ray.mutating.mutate_and_test([spec], pytest_command(copy, files, deselect, log, extra, stop_first=True), timeout)
    mutant.seconds = round(time.monotonic() - start, 1)
    leftovers = reap(copy)
    if leftovers:
        print(f"      killed {len(leftovers)} leftover process(es) of this run: {leftovers}", flush=True)
    if result.worker_outcome != WorkerOutcome.NORMAL:
        mutant.status, mutant.reason = "error", f"{result.worker_outcome.value}: {(result.output or '')[-500:]}"
        return
    if result.test_outcome == TestOutcome.SURVIVED:
        mutant.status = "survived"
        return
    if result.output == "timeout":
        mutant.status, mutant.reason = "timeout", f"tests ran past {timeout:.0f} s"
        return
    failed = [r for r in read_log(log) if r.get("outcome") == "failed"]
    if failed:
        r = failed[0]
        mutant.status, mutant.reason = "killed", f"{r['nodeid']} ({r['when']}): {r.get('message', '')}"
    elif "no tests ran" in (result.output or ""):
        mutant.status, mutant.reason = "survived", "every selected test was deselected"
    else:  # the test process died (segfault, internal error, import error before collection)
        tail = (result.output or "").strip().splitlines()[-1:] or [""]
        mutant.status, mutant.reason = "killed", f"test process failed without a failing test: {tail[0][:300]}"


# ----------------------------------------------------------------------------------------------
# Equivalents and reports
# ----------------------------------------------------------------------------------------------


def read_equivalents(path: Path) -> dict[str, str]:
    """``<mutant id>  <reason>`` per line; blank lines and lines starting with # are ignored."""
    entries: dict[str, str] = {}
    if not path.exists():
        return entries
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        mutant_id, _, reason = line.partition(" ")
        if not reason.strip():
            print(f"warning: {path.name}:{number}: {mutant_id} has no reason", file=sys.stderr)
        if mutant_id in entries:
            print(f"warning: {path.name}:{number}: {mutant_id} is listed twice (the later reason is kept)", file=sys.stderr)
        entries[mutant_id] = reason.strip()
    return entries


STATUSES = ("killed", "timeout", "survived", "equivalent", "error")


def tally(mutants: list[Mutant]) -> dict:
    counts = {s: sum(m.status == s for m in mutants) for s in STATUSES}
    changing = counts["killed"] + counts["timeout"] + counts["survived"]
    counts["sampled"] = len(mutants)
    counts["behaviour_changing"] = changing
    counts["kill_rate"] = round((counts["killed"] + counts["timeout"]) / changing, 4) if changing else None
    return counts


def pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def markdown(report: dict, mutants: list[Mutant]) -> str:
    out = [f"# Mutation testing: {report['finished']}", ""]
    out.append(f"Command: `{report['command']}`  ")
    out.append(
        f"cosmic-ray {report['cosmic_ray']}, seed {report['seed']}, {report['workers']} worker(s), "
        f"{report['seconds'] / 60:.1f} min (baseline {report['baseline']['seconds']:.0f} s)."
    )
    out += ["", "| target | mutants | sampled | killed | timeout | survived | equivalent (excluded) | error | kill rate |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = [*report["targets"].items(), ("**total**", report["total"])]
    for name, c in rows:
        out.append(
            f"| {name} | {c['population']} | {c['sampled']} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['equivalent']} | {c['error']} | {pct(c['kill_rate'])} |"
        )
    out += ["", "Kill rate = (killed + timeout) / (killed + timeout + survived); equivalents and errors are left out.", ""]
    if report["stale_equivalents"]:
        out += ["## Stale entries in tools/mutation_equivalent.txt (no such mutant any more)", ""]
        out += [f"- `{i}`" for i in report["stale_equivalents"]] + [""]
    if report["invalid_replaced"]:
        out += ["## Drawn but not valid mutants (replaced by further draws)", ""]
        out += [f"- `{r['id']}` line {r['line']}: {r['reason']}" for r in report["invalid_replaced"]] + [""]
    if report["baseline"]["failing"] or report["baseline"]["broken"]:
        out += ["## Tests that fail without any mutation (left out of every run)", ""]
        out += [f"- `{n}`" for n in report["baseline"]["broken"] + report["baseline"]["failing"]] + [""]
    for status, title in (("survived", "Surviving mutants"), ("timeout", "Timeouts (counted as killed)"), ("error", "Errors (left out of the score)"), ("equivalent", "Equivalent mutants drawn (excluded)")):
        chosen = [m for m in mutants if m.status == status]
        if not chosen:
            continue
        out += [f"## {title}: {len(chosen)}", ""]
        for path in sorted({m.path for m in chosen}):
            out += [f"### {path}", ""]
            for m in (m for m in chosen if m.path == path):
                where = f" in `{m.definition}`" if m.definition else ""
                tag = " [config field]" if m.in_config_field else ""
                out.append(f"- `{m.id}` line {m.line}{where}{tag}: `{m.original}` -> `{m.mutated}`" + (f" ({m.reason})" if m.reason else ""))
                if status == "survived":
                    out += ["", "  ```diff", *("  " + l for l in m.diff.rstrip().splitlines()), "  ```", ""]
            out.append("")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=TOOLS / "mutation.toml")
    parser.add_argument("--equivalents", type=Path, default=TOOLS / "mutation_equivalent.txt")
    parser.add_argument("--sample", type=int, default=None, help="mutants to draw (default: [sample] size in the config, 170)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    parser.add_argument("--workers", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    parser.add_argument("--paths", nargs="+", help="only mutate these files/folders (each inside a target)")
    parser.add_argument("--ids", nargs="+", help="run exactly these mutant ids instead of a sample")
    parser.add_argument("--all", action="store_true", help="run every mutant instead of a sample (slow)")
    parser.add_argument("--list", action="store_true", help="print the population and the sample, run nothing")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "mutation", help="folder for mutation.json and mutation.md")
    parser.add_argument("--keep", action="store_true", help="keep the private copy (its path is printed)")
    args = parser.parse_args(argv)

    config = tomllib.loads(args.config.read_text(encoding="utf-8"))
    n = args.sample if args.sample is not None else config["sample"]["size"]
    seed = args.seed if args.seed is not None else config["sample"]["seed"]
    targets: dict[str, list[str]] = config["targets"]
    run_cfg = config.get("run", {})
    extra = list(run_cfg.get("pytest_args", []))
    started = time.time()
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "tools/mutation.py", *(argv if argv is not None else sys.argv[1:])])

    workdir = Path(tempfile.mkdtemp(prefix="rlalign-mutation-"))
    copies = [workdir / f"copy{k}" for k in range(max(1, args.workers))]

    def stop(signum, frame):
        # the test commands run in sessions of their own, out of reach of Ctrl-C and of a SIGTERM
        # to this process: kill them first, then unwind (the private copy is removed below)
        signal.signal(signum, signal.SIG_IGN)
        for c in copies:
            reap(c)
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        copied = snapshot(copies[0])
        for c in copies[1:]:
            shutil.copytree(copies[0], c)
        print(f"private copy of the working tree ({copied} files): {copies[0]}", flush=True)

        files = sorted(
            p.relative_to(copies[0]).as_posix()
            for paths in targets.values()
            for spec in paths
            for p in ([copies[0] / spec] if spec.endswith(".py") else sorted((copies[0] / spec).rglob("*.py")))
            if p.is_file() and "__pycache__" not in p.parts
        )
        if args.paths:
            wanted = [p.rstrip("/") for p in args.paths]
            files = [f for f in files if any(_under(f, w) for w in wanted)]
            if not files:
                sys.exit(f"no target module under {args.paths}")
        population = enumerate_mutants(copies[0], files, targets, config["operators"], workdir)
        by_id = {m.id: m for m in population}
        populations = {t: sum(m.target == t for m in population) for t in targets}
        print("mutants per target: " + ", ".join(f"{t} {c}" for t, c in populations.items()) + f"; {len(population)} in all", flush=True)

        equivalents = read_equivalents(args.equivalents)
        stale = sorted(i for i in equivalents if i not in by_id and any(_under(i.split(":")[0], f) for f in files))
        for i in stale:
            print(f"warning: {args.equivalents.name}: {i} matches no mutant any more (its line changed or it was removed)", file=sys.stderr)

        source_cache: dict[str, str] = {}

        def source_of(path: str) -> str:
            if path not in source_cache:
                source_cache[path] = (copies[0] / path).read_text(encoding="utf-8")
            return source_cache[path]

        rejected: list[Mutant] = []
        if args.ids:
            unknown = [i for i in args.ids if i not in by_id]
            if unknown:
                sys.exit(f"unknown mutant ids: {unknown}")
            sample = [by_id[i] for i in args.ids]
        elif args.all:
            sample = list(population)
        else:
            sample, rejected = draw(population, list(targets), n, seed, config["sample"].get("min_per_target", 8), lambda m: describe(m, source_of(m.path)))
        for m in sample:
            if not m.diff and m.status == "pending":
                describe(m, source_of(m.path))
            if m.id in equivalents:
                m.status, m.reason = "equivalent", equivalents[m.id]
        print("sample: " + ", ".join(f"{t} {sum(m.target == t for m in sample)}" for t in targets) + f"; {len(sample)} in all, {sum(m.status == 'equivalent' for m in sample)} listed as equivalent", flush=True)
        for m in rejected:
            print(f"warning: not a valid mutant, replaced by another draw: {m.id} line {m.line}: {m.reason}", file=sys.stderr)
        if args.list:
            for m in sample:
                print(f"{m.id}  line {m.line}: {m.original}  ->  {m.mutated}" + ("  [equivalent]" if m.status == "equivalent" else ""))
            return 0

        selector = TestSelector(copies[0], config)
        to_run = [m for m in sample if m.status == "pending"]
        selections = {p: selector.select(p) for p in sorted({m.path for m in to_run})}
        union = list(dict.fromkeys(f for fs, _ in selections.values() for f in fs))
        union_deselect = sorted({d for _, ds in selections.values() for d in ds if all(d in ds2 for fs2, ds2 in selections.values() if d.split("::")[0] in fs2)})
        print(f"baseline: the {len(union)} selected test files, unmutated ...", flush=True)
        base = run_baseline(copies[0], union, union_deselect, extra, workdir)
        print(f"baseline: {base.seconds:.0f} s (start-up and collection {base.overhead:.0f} s), rlalign from {base.rlalign}", flush=True)
        for nodeid in base.broken + base.failing:
            print(f"warning: {nodeid} fails without any mutation; left out of every run", file=sys.stderr)
        selector.broken, selector.failing = set(base.broken), set(base.failing)
        selections = {p: selector.select(p) for p in selections}

        factor, constant = run_cfg.get("timeout_factor", 3.0), run_cfg.get("timeout_constant", 60.0)
        free = queue.Queue()
        for k, c in enumerate(copies):
            free.put((k, c))
        lock, done = threading.Lock(), [0]

        def work(m: Mutant) -> None:
            k, copy = free.get()
            try:
                fs, ds = selections[m.path]
                timeout = factor * (base.overhead + sum(base.file_seconds.get(f, 0.0) for f in fs)) + constant
                log = workdir / f"log{k}.jsonl"
                log.unlink(missing_ok=True)
                run_mutant(m, copy, fs, ds, timeout, extra, log)
            finally:
                free.put((k, copy))
            with lock:
                done[0] += 1
                print(f"[{done[0]:>3}/{len(to_run)}] {m.status:<8} {m.seconds:6.1f}s  {m.id}  line {m.line}: {m.original}  ->  {m.mutated}" + (f"\n      {m.reason}" if m.status != "survived" and m.reason else ""), flush=True)

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(copies))
        try:
            for f in concurrent.futures.as_completed([pool.submit(work, m) for m in to_run]):
                f.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # on Ctrl-C / SIGTERM: run nothing more

        report = {
            "command": command,
            "cosmic_ray": _version("cosmic-ray"),
            "finished": time.strftime("%Y-%m-%d %H:%M"),
            "seconds": round(time.time() - started, 1),
            "seed": seed,
            "sample_size": len(sample),
            "workers": len(copies),
            "baseline": asdict(base),
            "targets": {t: {"population": populations[t], **tally([m for m in sample if m.target == t])} for t in targets},
            "total": {"population": len(population), **tally(sample)},
            "stale_equivalents": stale,
            "invalid_replaced": [{"id": m.id, "line": m.line, "reason": m.reason} for m in rejected],
            "mutants": [asdict(m) for m in sample],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mutation.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        md = markdown(report, sample)
        (args.out / "mutation.md").write_text(md, encoding="utf-8")
        print()
        print(md.split("\n## ")[0])
        survivors = [m for m in sample if m.status == "survived"]
        if survivors:
            print(f"survivors ({len(survivors)}):")
            for m in survivors:
                print(f"  {m.id}  line {m.line}: {m.original}  ->  {m.mutated}" + ("  [config field]" if m.in_config_field else "") + (f"  [{m.reason}]" if m.reason else ""))
        print(f"\nwritten: {args.out / 'mutation.json'}, {args.out / 'mutation.md'}")
        return 0
    finally:
        for c in copies:
            reap(c)
        if args.keep:
            print(f"private copy kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
