"""CPU speed machinery: linear weights held in oneDNN's blocked layout for the decode loop.

    copy = cast_copy(policy, "bfloat16")
    if can_pack_linear(copy):
        pack_linear_layers(copy)        # every nn.Linear -> PackedLinear (same values, read faster)
    ...                                 # after an update of the weights:
    repack_linear_layers(copy)

Used by GRPO and PPO with ``sampling.dtype`` and ``sampling.pack_weights`` (on by default), and by
nothing else: imported only then. The oneDNN ops it calls are private torch symbols, listed in
:mod:`rlalign.lm.private`; without them :func:`can_pack_linear` is False and the plain
``nn.Linear`` runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlalign.lm import private

__all__ = ["PackedLinear", "SharedProduct", "SHARED_INPUT_LAYERS", "can_pack_linear", "pack_linear_layers", "repack_linear_layers"]


def _packed_linear_kernel(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# oneDNN's linear on a weight in its blocked layout as an opaque op, so torch.compile calls it as it
# is (inductor's own lowering of _linear_pointwise wants the weight as a graph constant). Defined
# through torch.library.Library rather than torch.library.custom_op, whose Python dispatch costs about
# half the kernel's own time again, and the decode loop makes hundreds of such calls a token.
_OPS = torch.library.Library("rlalign", "FRAGMENT")
if not hasattr(torch.ops.rlalign, "packed_linear"):  # once per process (a reloaded module finds it)
    _OPS.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
    _OPS.impl("packed_linear", _packed_linear_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("rlalign::packed_linear", _packed_linear_shape, lib=_OPS)


# Sibling linear layers that a transformers decoder layer calls on the same input, one after the
# other (Llama, Mistral, Qwen2/3, Gemma, SmolLM, OLMo, ...): packed as one weight, run as one matmul.
SHARED_INPUT_LAYERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct:
    """The sibling layers of one :data:`SHARED_INPUT_LAYERS` group after :func:`pack_linear_layers`,
    run as one matmul: ``packed`` holds the blocked concatenation [W_1; W_2; ...] (and ``bias`` the
    concatenated biases). The first sibling called on an input computes x @ packed^T and keeps the
    parts until every sibling has taken its own. A sibling called on another tensor (by identity,
    and, eager, by the in-place version counter unless under ``torch.inference_mode``) while parts
    are still untaken (a model that skips a sibling or feeds them different inputs, a tensor changed
    in place, a forward that raised midway) turns the sharing off for good: each sibling is then
    ``F.linear`` on its own weight, correct and slower. Not a module; it refers to the siblings
    weakly (no reference cycle keeps a model's weights alive)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.siblings: list[Callable[[], PackedLinear | None]] = [lambda: None] * len(sizes)  # weak references, set by PackedLinear
        self.packed: Tensor | None = None
        self.bias: Tensor | None = None
        self.sharing = True
        self.input: Tensor | None = None  # the input of the product in ``parts``, until every sibling took its part
        self.version = 0  # ``input._version`` then (eager, outside inference mode)
        self.parts: tuple[Tensor, ...] | None = None
        self.unread = 0

    @torch.no_grad()
    def repack(self) -> None:
        """The blocked concatenation of the siblings' current weights and biases."""
        siblings = [sibling() for sibling in self.siblings]
        if any(sibling is None for sibling in siblings):  # set up, or a sibling is gone: nothing to pack yet
            return
        self.packed = PackedLinear.pack(torch.cat([sibling.weight.detach() for sibling in siblings]))
        self.bias = None if siblings[0].bias is None else torch.cat([sibling.bias.detach() for sibling in siblings])

    def part(self, index: int, x: Tensor) -> Tensor | None:
        """Sibling ``index``'s output for input ``x``, or None once sharing is off."""
        versioned = not torch.compiler.is_compiling() and not x.is_inference()  # inference tensors have no version counter
        if self.input is not x or (versioned and self.version != x._version):
            if self.unread:  # the last product was not taken by every sibling
                self.sharing, self.input, self.parts, self.unread = False, None, None, 0
            if not self.sharing:
                return None
            product = PackedLinear.product(x, self.packed, self.bias, sum(self.sizes))
            self.input, self.parts, self.unread = x, product.split(self.sizes, -1), len(self.sizes)
            self.version = x._version if versioned else 0
        part = self.parts[index]
        self.unread -= 1
        if self.unread == 0:  # every sibling has its part: let go of the tensors
            self.input = self.parts = None
        return part


class PackedLinear(nn.Module):
    """An inference-only ``nn.Linear`` whose weight is also held in oneDNN's blocked layout, the one
    its CPU matmul kernel reads fastest (``torch.ops.mkldnn._reorder_linear_weight``, run by
    ``torch.ops.mkldnn._linear_pointwise``: the kernel inductor uses for frozen weights).

    The values are those of ``F.linear`` (bit for bit in bfloat16 for contiguous inputs, at 1 to
    100 rows, on the CPUs tested; float32 round-off apart, as F.linear runs MKL there); what changes
    is how fast the weight streams from memory, which is where a decode loop spends its time: it
    reads every weight once per token (benchmarks/RESULTS.md has the measured speed).

    ``weight`` and ``bias`` stay the module's parameters (the same objects: tied weights stay tied,
    :func:`rlalign.lm.models.copy_weights` still sees the model's structure), so the blocked copy, the non-persistent
    buffer ``packed``, costs one more copy of the weight; :meth:`repack` must follow any change to
    ``weight``. Replacing the buffer does not recompile a compiled caller (buffers are graph inputs).
    With ``shared`` (a :class:`SharedProduct`) the layer is sibling ``index`` of a group run as one
    matmul, whose blocked weight the group holds (the layer none of its own); :meth:`repack` of any
    sibling refreshes the group's: fewer, larger matmuls a token.
    No gradient flows through the packed path: when grad mode is on and the input or a parameter
    needs a gradient, under autocast, or for an input of another dtype, :meth:`forward` is
    ``F.linear``. The blocked buffer is an opaque MKLDNN tensor: ``copy.deepcopy``, pickling and
    ``.to(dtype)`` of a model holding it raise; build such copies before :func:`pack_linear_layers`.
    """

    def __init__(self, linear: nn.Linear, shared: SharedProduct | None = None, index: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.shared, self.index = shared, index
        if shared is not None:
            shared.siblings[index] = weakref.ref(self)
        self.register_buffer("packed", None, persistent=False)
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        """Refresh the blocked copy from ``weight`` (a sibling's: the group's, from all siblings' weights)."""
        if self.shared is None:
            self.packed = self.pack(self.weight)
        else:
            self.shared.repack()

    @staticmethod
    def pack(weight: Tensor) -> Tensor:
        """``weight`` (out, in) in oneDNN's blocked layout, an opaque MKLDNN tensor."""
        # the row-count hint hardly changes the layout's speed (1-512 rows tried): any fixed value does
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)

    @staticmethod
    def product(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
        """x @ W^T + b with W blocked in ``packed``. Shape: (..., in) -> (..., out_features)."""
        if torch.compiler.is_compiling():  # rows flattened here, where a view is free, not inside the kernel
            rows = torch.ops.rlalign.packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, out_features)
            return rows.view(*x.shape[:-1], out_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # eager: the kernel itself, without the op's dispatch

    def forward(self, x: Tensor) -> Tensor:
        needs_grad = x.requires_grad or self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if x.dtype != self.weight.dtype or torch.is_autocast_enabled(x.device.type) or torch.is_grad_enabled() and needs_grad:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.shared is None:
            return self.product(x, self.packed, self.bias, self.out_features)
        part = self.shared.part(self.index, x)
        return nn.functional.linear(x, self.weight, self.bias) if part is None else part

    def extra_repr(self) -> str:
        shared = "" if self.shared is None else f", sibling {self.index} of {len(self.shared.sizes)} run as one matmul"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed for oneDNN{shared}"


def can_pack_linear(model: nn.Module) -> bool:
    """Whether :func:`pack_linear_layers` pays: every parameter on the CPU, in bfloat16 or float16,
    with oneDNN kernels for that dtype on this CPU. Float32 is left out: there F.linear runs MKL,
    which is as fast or faster for all but large weights; in half precision the blocked kernel is
    the faster one at every size measured."""
    if not torch.backends.mkldnn.is_available() or not private.ready("packed"):
        return False
    supported = set()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        supported.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        supported.add(torch.float16)
    return all(p.device.type == "cpu" and p.dtype in supported for p in model.parameters())


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` (exactly that class; subclasses such as quantised layers are left
    alone) of an inference-only ``model`` for a :class:`PackedLinear` holding the same parameters;
    returns how many. Siblings named as in :data:`SHARED_INPUT_LAYERS` (all plain ``nn.Linear``
    with the same input size, dtype and device, all with or all without bias) become one
    :class:`SharedProduct`. Inside a peft LoRA layer the base layer and the adapters' A and B are
    plain ``nn.Linear`` and are packed too (the LoRA layer calls them; not as siblings), so merging
    adapters into the weights afterwards needs :func:`repack_linear_layers`. Check :func:`can_pack_linear` first."""
    siblings: dict[int, tuple[SharedProduct, int]] = {}
    for parent in model.modules():
        for names in SHARED_INPUT_LAYERS:
            linears = [parent._modules.get(name) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            if len({(linear.in_features, linear.weight.dtype, linear.weight.device, linear.bias is None) for linear in linears}) == 1:
                shared = SharedProduct([linear.out_features for linear in linears])
                siblings.update({id(linear): (shared, index) for index, linear in enumerate(linears)})
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, *siblings.get(id(child), (None, 0))))  # the group packs when its last sibling exists
    return len(swaps)


def repack_linear_layers(model: nn.Module) -> None:
    """Refresh the blocked copies of ``model``'s :class:`PackedLinear` layers after its weights changed."""
    for module in model.modules():
        if isinstance(module, PackedLinear) and (module.shared is None or module.index == 0):  # a group once
            module.repack()
