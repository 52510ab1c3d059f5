"""CPU speed machinery: the compiled decode step of :func:`rlalign.lm.sampling.sample` (``compile=True``)
and the compiler workarounds that keep a compiling process's memory down.

    steps = CompiledSteps(cache_keyword)     # the decode step and the draw through torch.compile, eager past the cap
    with releasing_compiler_caches():        # a training forward compiled by torch.compile (GRPO / PPO ``compile``)
        ...

Imported only when a compile option is on. The private torch symbols it touches are listed in
:mod:`rlalign.lm.private`; where one is missing, ``sample(compile=True)`` warns once and runs the
plain eager loop.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from rlalign.lm import private
from rlalign.lm.decode import SamplingParams, _decode_step, _draw

__all__ = ["RECOMPILE_LIMIT", "CompiledSteps", "release_compiler_caches", "releasing_compiler_caches", "skipping_guard_profiling"]

RECOMPILE_LIMIT = 64  # compiled versions kept of the decode step and of the draw (torch's default is 8)


def _decode_inductor_options() -> dict:
    """Inductor lowers a one-query-row attention matmul on the CPU to a multiply-and-sum that inlines
    its inputs, and so recomputed the query's rotary embedding (a cos and a sin an element) for every
    key position: a pointwise input of more than 4 ops is computed once into a buffer instead, which
    makes that attention kernel several times faster. A torch without that option (2.11) compiles
    the step with inductor's defaults; the option does not apply to GPU kernels anyway."""
    return {} if private.missing("cpu_decode_tuning") else {"realize_cpu_opcount_threshold": 4}


class _CompiledOnFirstCall:
    """``torch.compile(fn, **options)``, made at the first call (``inductor_options()`` gives its
    ``options``). Calling ``torch.compile`` imports dynamo's backends (AOT autograd, its partitioner,
    networkx: ~380 modules), which a process that only samples eagerly never needs, and whose memory
    it would carry for nothing.

    A torch whose ``torch.compile`` takes no ``recompile_limit`` (2.11) gets the limit as dynamo's
    global settings around each call instead (``recompile_limit``, ``fail_on_recompile_limit_hit``),
    so past it the call raises ``FailOnRecompileLimitHit`` there too."""

    def __init__(self, fn: Callable, inductor_options: Callable[[], dict] | None = None, **options):
        self.fn, self.inductor_options, self.options, self.compiled = fn, inductor_options, options, None
        self.limits: dict = {}  # dynamo settings patched around each call (a torch without the per-function limit)

    def __call__(self, *args):
        if self.compiled is None:
            options = dict(self.options)
            if "recompile_limit" in options and not compile_takes_recompile_limit():
                limits = {"recompile_limit": options.pop("recompile_limit"), "fail_on_recompile_limit_hit": True}
                self.limits = {k: v for k, v in limits.items() if hasattr(torch._dynamo.config, k)}  # settings this torch has
            extra = {"options": self.inductor_options()} if self.inductor_options is not None else {}
            self.compiled = torch.compile(self.fn, **options, **extra)
        if self.limits:
            with torch._dynamo.config.patch(**self.limits):
                return self.compiled(*args)
        return self.compiled(*args)


def compile_takes_recompile_limit() -> bool:
    """Whether this torch's ``torch.compile`` takes a per-function ``recompile_limit`` (2.13 does, 2.11 not)."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


_compiled_decode_step = _CompiledOnFirstCall(_decode_step, _decode_inductor_options, fullgraph=True, dynamic=False, recompile_limit=RECOMPILE_LIMIT)
_graphed_decode_step = _CompiledOnFirstCall(  # the same step, replayed as a CUDA graph (torch.compile's "reduce-overhead")
    _decode_step, lambda: {**_decode_inductor_options(), "triton.cudagraphs": True}, fullgraph=True, dynamic=False, recompile_limit=RECOMPILE_LIMIT
)
_compiled_draw = _CompiledOnFirstCall(_draw, fullgraph=True, dynamic=False, recompile_limit=RECOMPILE_LIMIT)


class CompiledSteps:
    """The decode step and the draw of one ``sample(compile=True)`` call, compiled. When torch has
    compiled RECOMPILE_LIMIT versions of one of them in this process it warns and the call goes on
    eager (no half-finished step: the limit is checked before a compiled version runs).

    With ``cuda_graphs`` the decode step is compiled with inductor's CUDA graphs: each step marks a
    new cudagraph-trees step first, since the loop reads a step's outputs (token, log-prob) before
    the next replay overwrites them and keeps none of them past it."""

    def __init__(self, cache_keyword: str, cuda_graphs: bool = False):
        self.compiled = True
        self.cache_keyword = cache_keyword  # cache_argument(model): inspect has no place in a compiled step
        self.cuda_graphs = cuda_graphs

    def _call(self, compiled_fn, eager_fn, *args):
        if self.compiled:
            try:
                return compiled_fn(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(
                    f"sample(compile=True): {RECOMPILE_LIMIT} compiled versions of the decode step exist in this process (one per batch "
                    "size, cache-length bucket, model dtype, attention kernel, ...); this call runs eager",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.compiled = False
        return eager_fn(*args)

    def draw(self, logits: Tensor, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._call(_compiled_draw, _draw, logits, params, uniform)

    def decode(
        self, model: nn.Module, token: Tensor, step_mask: Tensor | dict[str, Tensor], position_ids: Tensor, cache, params: SamplingParams, uniform: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        compiled_fn = _graphed_decode_step if self.cuda_graphs else _compiled_decode_step
        return self._call(compiled_fn, _decode_step, model, token, step_mask, position_ids, cache, self.cache_keyword, params, uniform)



def _compiled_graph_count() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def release_compiler_caches() -> None:
    """Drop what torch.compile keeps only to compile faster, not to run what it compiled: the source
    lines dynamo read (``linecache``), the fake-tensor dispatch cache, sympy's cache; then collect and
    hand freed heap pages back to the OS (glibc's ``malloc_trim``). A later compile refills them.
    Lowers both the resident memory after a compile and the process's peak (benchmarks/RESULTS.md)."""
    import ctypes
    import gc
    import linecache

    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode

    linecache.clearcache()
    getattr(FakeTensorMode, "cache", {}).clear()
    sympy.core.cache.clear_cache()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def releasing_compiler_caches() -> Iterator[None]:
    """Run the block with :func:`skipping_guard_profiling`; when it compiled a graph (torch.compile's
    count of graphs grew), call :func:`release_compiler_caches` after it, so the next compile (the
    training pass after the reference pass, say) does not start on top of this one's leftovers.
    Costs a counter read and two attribute swaps when nothing compiled."""
    graphs = _compiled_graph_count()
    try:
        with skipping_guard_profiling():
            yield
    finally:
        if _compiled_graph_count() != graphs:
            release_compiler_caches()


@contextlib.contextmanager
def skipping_guard_profiling() -> Iterator[None]:
    """Inside the block, a graph dynamo compiles skips its guard-latency measurement.

    After building a graph's guards, dynamo times one evaluation of them for a log metric
    (``guard_latency_us``), first flushing the CPU caches by writing a fresh 32 MiB buffer
    (``torch._C._dynamo.guards.profile_guard_manager``, torch 2.13). The buffer is freed at once,
    but it sets the process's peak resident memory 32 MiB above what compiling needs, at every
    compile. Here the measurement reports 0 us instead; guards are still built, checked once
    against the frame that made them, and evaluated at every call as before. Resident memory is
    unchanged; only the peak goes down."""
    from torch._dynamo import guards  # imported by transformers' models already; the block is about to compile anyway

    if not hasattr(guards, "profile_guard_manager"):  # a torch without the measurement
        yield
        return
    global _guard_profiling_depth, _torch_guard_profile
    with _guard_profiling_lock:  # nested blocks, or blocks in several threads: the first in swaps, the last out restores
        if _guard_profiling_depth == 0:
            _torch_guard_profile, guards.profile_guard_manager = guards.profile_guard_manager, _no_guard_profile
        _guard_profiling_depth += 1
    try:
        yield
    finally:
        with _guard_profiling_lock:
            _guard_profiling_depth -= 1
            if _guard_profiling_depth == 0:
                guards.profile_guard_manager = _torch_guard_profile


_guard_profiling_lock = threading.Lock()
_guard_profiling_depth = 0  # blocks now inside skipping_guard_profiling
_torch_guard_profile: Callable | None = None  # torch's own function, while they are


def _no_guard_profile(*args, **kwargs) -> float:
    return 0.0
