"""Host-side helpers shared by the Triton kernel modules (launch arguments, device checks)."""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
from triton import knobs
from triton.runtime import driver

from kernels.reference import _byte_span, _check_inference_write

# Triton passes Python floats to kernels as fp32 scalars.
FP32_MAX = torch.finfo(torch.float32).max

# Read once at import, like Triton itself (``triton.jit`` picks the interpreter at decoration time).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """Strides of an optional tensor (zeros for an absent one, whose pointer is never read)."""
    return tuple(t.stride()) if t is not None else (0,) * ndim


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``, whose wrapper
    (a constexpr function in recent Triton) costs microseconds per call on the eager decode path."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0, as ``triton.cdiv``, which recent Triton also wraps as a constexpr
    function (microseconds per host call, several per eager launch)."""
    return (a + b - 1) // b


def device_guard(t: torch.Tensor):
    """``torch.cuda.device`` of a CUDA tensor (launches go to its GPU); a no-op context otherwise."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def sm_count(device: torch.device, fallback: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs host time on every
    eager launch otherwise); ``fallback`` for any other device (the CPU under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return fallback


def check_interpreter_dtype(op: str, *tensors: torch.Tensor | None) -> None:
    """Refuse bfloat16 CPU tensors under the interpreter: Triton's CPU emulation computes bf16
    arithmetic and bf16 ``tl.dot`` wrongly (a 16 x 16 bf16 dot came out ~1e10 off with Triton 3.9),
    which would be silent wrong numbers. On CPU the kernels are tested in float16 / float32 / float64.

    Raises:
        ValueError: ``INTERPRET`` is set and a (non-None) CPU tensor is bfloat16; the message says to
            use float16 / float32 or backend='reference'.
    """
    if INTERPRET and any(
        t is not None and t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors
    ):
        raise ValueError(
            f"the Triton {op} cannot run bfloat16 under the CPU interpreter (TRITON_INTERPRET=1 emulates "
            "bf16 wrongly); use float16 or float32 on CPU, backend='reference', or a CUDA GPU"
        )


INT32_OFFSETS = 2**31  # offsets a kernel forms as int32 index x stride must stay below this


def check_int32_offsets(
    op: str, fix: str, dims: tuple[int, ...], **tensors: torch.Tensor | torch.Size | None
) -> None:
    """Refuse a tensor whose offsets along ``dims`` reach 2**31 elements, which the kernels would
    wrap: they add ``index * stride`` to a row's base pointer in int32 for each dim whose stride
    fits int32 (Triton passes larger ints as int64, so a stride of 2**31 or more is safe). The
    batch and head offsets are int64; the sequence and feature dims are not.

    Args:
        op: the op's name for the message.
        fix: what to do instead, appended to the message.
        dims: the dims the kernels index with int32 (e.g. (1, 3): T and the feature dim of (B, T, H, D)).
        tensors: name -> tensor, or the ``torch.Size`` of a contiguous one yet to be allocated (an
            output); None is skipped.

    Raises:
        ValueError: (size - 1) * |stride| >= 2**31 along one of ``dims``, naming the tensor, the dim,
            its size and stride, and ``fix``.
    """
    for name, t in tensors.items():
        if t is None or (isinstance(t, torch.Size) and math.prod(t) <= INT32_OFFSETS):
            continue  # (a contiguous tensor's offsets stay below its element count)
        for dim in dims:
            if isinstance(t, torch.Size):  # contiguous
                size, stride = t[dim], math.prod(t[dim + 1 :])
            else:
                size, stride = t.shape[dim], abs(t.stride(dim))
            if stride < INT32_OFFSETS and (size - 1) * stride >= INT32_OFFSETS:
                raise ValueError(
                    f"the Triton {op} indexes {name} with int32 offsets, but its dim {dim} spans "
                    f"({size} - 1) x stride {stride} = {(size - 1) * stride} elements, past 2**31 - 1; {fix}"
                )


def check_device(op: str, *tensors: torch.Tensor | None) -> None:
    """A Triton op's own device limit for tensors already known to share one device (the ops whose
    shared validation checks that): CUDA, or the CPU under ``TRITON_INTERPRET=1``.

    Raises:
        ValueError: a device other than CUDA and the CPU, CPU tensors without the interpreter (the
            message says to set TRITON_INTERPRET=1 or use backend='reference'), or bfloat16 CPU
            tensors under it (:func:`check_interpreter_dtype`).
    """
    device = next(t.device for t in tensors if t is not None)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the Triton {op} runs on CUDA (or the CPU under TRITON_INTERPRET=1), got {device}")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton {op} needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing kernels, or use backend='reference'"
        )
    check_interpreter_dtype(op, *tensors)


def check_no_grad(op: str, **tensors: torch.Tensor | None) -> None:
    """Refuse inputs that require grad in grad mode for an op without a backward (the decode
    steps): its output would not require grad, so gradients would stop there without a word.

    Raises:
        RuntimeError: grad mode is on and a named tensor requires grad; the message names them and
            says to run under torch.no_grad() / torch.inference_mode(), detach, or use
            backend='reference'.
    """
    if not torch.is_grad_enabled():
        return
    needing = [name for name, t in tensors.items() if t is not None and t.requires_grad]
    if needing:
        raise RuntimeError(
            f"the Triton {op} is not differentiable (it is the decode path), but {', '.join(needing)} "
            f"require{'s' if len(needing) == 1 else ''} grad; call it under torch.no_grad() or "
            "torch.inference_mode(), detach the inputs, "
            "or use backend='reference'"
        )


def check_fp32_scalars(op: str, factor: float = 1.0, **scalars: float) -> None:
    """Refuse scalar arguments that a kernel would receive as inf: ``value * factor`` beyond fp32's
    range (``factor``: what the host multiplies in first, e.g. log2(e) for a base-2 softmax scale).

    Raises:
        ValueError: ``|value * factor| > FP32_MAX`` (~3.4e38); the message names the argument and
            its value and says to use backend='reference' with float64 inputs.
    """
    for name, value in scalars.items():
        if abs(value) * factor > FP32_MAX:
            raise ValueError(
                f"{op}: {name} {value:g} overflows float32, the Triton kernels' scalar type; "
                "use backend='reference' with float64 inputs"
            )


def mark_written(**states: torch.Tensor | None) -> None:
    """Record that a Triton decode step is about to write ``states`` in place (None ones skipped), as
    a PyTorch in-place op would: each state's version counter goes up, so autograd refuses a backward
    through a value the step overwrote (a kernel's writes are invisible to it otherwise). An
    inference tensor outside ``torch.inference_mode()`` is refused
    (:func:`kernels.reference._check_inference_write`, which the ordinary path's checks ran too;
    a replay skips those). Called before the launch: nothing is written when it raises.

    Raises:
        RuntimeError: a state made under ``torch.inference_mode()``, updated outside it.
    """
    for name, t in states.items():
        if t is None:
            continue
        _check_inference_write(name, t)
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)


def split_fp64(x: float) -> tuple[float, float]:
    """x as hi + lo, both fp32-representable (Triton passes Python floats as fp32), so fp64 kernels
    can rebuild x to ~2^-48 relative; call :func:`check_fp32_scalars` first (hi of an x beyond fp32's
    range is inf)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, x - hi


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook is set (``triton.knobs.runtime.launch_enter_hook`` /
    ``launch_exit_hook``, which profilers such as Proton install): :class:`CompiledLaunch` calls no
    hook and passes no launch metadata, so callers take the ordinary launch while one is. Recent
    Triton keeps each hook as a ``HookChain``, set when its list of calls is not empty; older
    Triton as a function or None."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        calls = getattr(hook, "calls", None)
        if hook is not None and (calls or not isinstance(calls, list)):
            return True
    return False


class CompiledLaunch:
    """One Triton launch replayed through the compiled kernel that an ordinary launch returned.

    ``JITFunction.run`` binds and specializes every argument on every call (the dtype and 16-byte
    alignment of each pointer, the type of each scalar), then looks the result up in its kernel
    cache: on the H200 machine about half of an eager ``flash_decode`` call's ~90 µs of host time
    across its two launches (cProfile, 2026-12-03, ``benchmarks/results/2026-12-03-nvidia-h200-host-time.json``).
    An eager decode loop repeats the same shapes, so the op caches this object per call signature and
    passes new tensors straight to the compiled kernel's launcher, which is what
    ``CompiledKernel.__getitem__(grid)(*args)`` does too, minus its per-call stream lookup.

    Correctness rests on the caller's cache key: it must determine every non-tensor argument and
    every tensor's dtype, device and ``data_ptr() % 16 == 0``, the whole of Triton's specialization,
    so that the replayed kernel is the one ``JITFunction.run`` would pick. Replays pass no launch
    metadata: callers check :func:`launch_hooks_installed` first.

    Args (of :meth:`build`):
        kernel: the ``triton.jit`` function launched.
        compiled: what ``kernel[grid](*args, **kwargs)`` returned (a ``CompiledKernel``).
        grid: the launch grid, 1 to 3 ints.
        args: the positional arguments, the ``num_tensors`` tensors first.
        kwargs: the remaining kernel parameters (constexprs) by name, plus launch options
            (``num_warps``, ``num_stages``), which the compiled kernel already holds.
        num_tensors: how many leading positional arguments change between replays.
    """

    def __init__(self, launcher, function, packed_metadata, grid: tuple[int, int, int], fixed: tuple, device, stream):
        self._launcher = launcher
        self._function = function
        self._packed_metadata = packed_metadata
        self._grid = grid
        self._fixed = fixed
        self._device = device
        self._stream = stream

    @classmethod
    def build(cls, kernel, compiled, grid, args: tuple, kwargs: dict, num_tensors: int) -> CompiledLaunch | None:
        """The replay of ``kernel[grid](*args, **kwargs)``, or None where this Triton cannot replay it
        (the interpreter returns no compiled kernel; a parameter left to its default value; another
        ``CompiledKernel`` layout). The arguments are ordered as the kernel's parameters, constexprs
        included, which is how ``JITFunction.run`` hands them to the launcher."""
        names = [param.name for param in getattr(kernel, "params", ())]
        try:
            launcher, function, packed = compiled.run, compiled.function, compiled.packed_metadata
            values = list(args) + [kwargs[name] for name in names[len(args) :]]
        except (AttributeError, KeyError):
            return None
        if not names or len(values) != len(names) or not 1 <= len(grid) <= 3:
            return None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        device = args[0].device.index
        return cls(launcher, function, packed, grid, tuple(values[num_tensors:]), device, driver.active.get_current_stream)

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launch on the current stream of the kernel's device with ``tensors`` in place of the first
        ``num_tensors`` arguments (which must match the build's in dtype, device and alignment)."""
        self._launcher(
            *self._grid, self._stream(self._device), self._function, self._packed_metadata,
            None, None, None, *tensors, *self._fixed,
        )  # fmt: skip


class LaunchPlans:
    """The replayable launches of one decode-step op, by call signature (at most ``max_plans``,
    oldest dropped first: a decode loop uses one or two, a sweep over shapes should not hold them all).

    An op keys every eager call with :meth:`key`, looks the key up with :meth:`get` and, on a hit,
    replays the stored plan (a :class:`CompiledLaunch` plus the op's fresh outputs) instead of its
    argument checks, tile choice and ``JITFunction.run``. Only a call that passed every check on the
    ordinary path and launched stores a plan (:meth:`remember`), so a key must determine everything
    those checks, the tile choice and the launch depend on except the tensors' addresses; a check
    that reads addresses (states written in place that share memory with another tensor, see
    :class:`WrittenApart`) must be redone by the replay, which falls back to the ordinary path.

    Attributes:
        device_types: the device types whose calls get a key (CUDA: the interpreter returns no
            compiled kernel to replay); tests widen it to replay fake compiled kernels on CPU.
    """

    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, max_plans: int = 64):
        self.max_plans = max_plans
        self._plans: dict[tuple, object] = {}

    def key(self, scalars: tuple, *tensors: torch.Tensor | None) -> tuple | None:
        """The call signature of a call with non-tensor arguments ``scalars`` and tensors ``tensors``
        (the first one not None): each scalar's type and value (and a float zero's sign: -0.0 == 0.0,
        but a kernel sees the sign), then each tensor's shape, strides, dtype, device and
        ``data_ptr() % 16 == 0`` (Triton's pointer specialization), None for an absent one; one
        flat tuple (built on every eager call).

        None where no plan applies: a scalar other than None / bool / int / float (the op's checks
        refuse it, or it might not hash), a tensor that is not a plain strided ``torch.Tensor``, the
        first tensor on a device type outside ``device_types``, or grad mode with a tensor that
        requires grad (the decode steps have no backward and refuse it: the ordinary path raises);
        also a first tensor that is None (the ordinary path refuses it).
        """
        key = []
        for x in scalars:
            kind = type(x)
            if kind is float:
                key += (kind, x, x == 0.0 and math.copysign(1.0, x))
            elif kind is bool or kind is int or x is None:
                key += (kind, x)
            else:
                return None
        grad = torch.is_grad_enabled()
        for t in tensors:
            if t is None:
                key.append(None)
            elif type(t) is not torch.Tensor or t.layout is not torch.strided or (grad and t.requires_grad):
                return None
            else:
                key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
        if tensors[0] is None or tensors[0].device.type not in self.device_types:
            return None
        return tuple(key)

    def get(self, key: tuple | None):
        """The plan stored under ``key``, or None: no key, no plan, or a launch hook installed
        (:func:`launch_hooks_installed`: a replay calls no hook, so the ordinary launch runs)."""
        plan = self._plans.get(key) if key is not None else None
        if plan is None or launch_hooks_installed():
            return None
        return plan

    def remember(self, key: tuple, plan) -> None:
        """Store a plan, dropping the oldest beyond ``max_plans``."""
        if key not in self._plans and len(self._plans) >= self.max_plans:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan

    def clear(self) -> None:
        """Forget every remembered launch (the next call of each signature takes the ordinary path)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key) -> bool:
        return key in self._plans


def byte_extent(t: torch.Tensor | None) -> int:
    """Bytes from ``t.data_ptr()`` that a tensor's elements can touch (0 for None or an empty one):
    the length of :func:`kernels.reference._byte_span`."""
    if t is None or not t.numel():
        return 0
    start, end = _byte_span(t)
    return end - start


class WrittenApart:
    """A replay's stand-in for the checks that a step's states written in place share no memory with
    each other nor with the tensors it reads (:func:`kernels.reference._check_updated_in_place`,
    :func:`kernels.reference._check_read_apart`): those compare byte spans within one storage, which
    are the tensors' address spans less the storage's base, so tensors whose address spans are
    disjoint pass them. Conservative: any overlap of address spans (an error, or memory aliased
    across storages) returns False and the op takes its ordinary path, whose checks decide.

    Args:
        tensors: the build's tensors (None for absent ones), for their spans (fixed by the plan key).
        written: the indices of the states written in place.
    """

    def __init__(self, tensors: tuple, written: tuple[int, ...]):
        extents = [byte_extent(t) for t in tensors]
        self._pairs = tuple(
            (i, extents[i], j, extents[j])
            for i in written
            for j in range(len(tensors))
            if j != i and not (j in written and j < i) and extents[i] and extents[j]
        )
        self._used = tuple(i for i, extent in enumerate(extents) if extent)

    def __call__(self, tensors: tuple) -> bool:
        """Whether no written state's address span overlaps another tensor's."""
        if not self._pairs:
            return True
        ptrs = [0] * len(tensors)
        for i in self._used:
            ptrs[i] = tensors[i].data_ptr()
        for i, extent_i, j, extent_j in self._pairs:
            if ptrs[i] < ptrs[j] + extent_j and ptrs[j] < ptrs[i] + extent_i:
                return False
        return True


def replay_guard(device: torch.device):
    """The device context of a replayed launch on ``device``: the launcher launches on the current
    device's context, so switch only when a CUDA device is not the current one (a no-op context
    otherwise, as on the CPU)."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)
