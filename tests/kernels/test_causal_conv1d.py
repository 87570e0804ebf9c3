"""The causal-conv1d Triton kernels (kernels/causal_conv1d.py) against the reference.

Accuracy rule (flash-attention's, as in test_selective_scan.py): with the float64 reference on the
same (dtype-rounded) inputs as ground truth,

    err(kernel in dtype X)  <=  2 * err(naive conv in dtype X) + atol   (y)
                                3 * ...                             (dx, dweight, dbias)

where "naive" is the reference itself run on the X inputs: the width shifted multiply-adds in
float32 (the precision the kernel accumulates in; for 16-bit X both round the results to X the same
way), its gradients by autograd. ``atol = 2 eps(X) max|x|`` is two units in the last place of X at
the values' magnitude (flash-attn's rounding atol, in closed form). On the GPU, ``tl.exp`` is
``ex2.approx`` (about 2^-21 relative error in the sigmoid), which the naive path's exact ``exp``
lacks: fp32 runs with silu there allow 2^-18 of the values' magnitude on top. float64 runs are
compared with the reference at 1e-12.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with
chunks of 8 steps, segments of 16 and 8 channels per program, so the tiny cases below cross chunks,
segments and channel blocks with partial ones at the end, and cover every *kind* of case once:
L = 1, 17, 65, 127 against widths 2, 3, 4 (and 1, 5, 6, 9 in float64); dims that are not a multiple
of the channel block; with and without bias, silu or none, fp32 and fp16 (bf16 is not reliable
under the interpreter: GPU only); mixed dtypes (16-bit x, fp32 taps); both algorithms (register
window, shifted loads) on every layout (contiguous, channel-last, windows of NaN-padded buffers) and
output gradients of any strides; NaN-poisoned buffers; empty inputs; the decode update (in place,
strided windows, prefill + step-by-step == full forward, the mixers' cache path); errors. The full
product, bf16 and realistic shapes (32x2048x2048, each autotune config forced in turn, the mixer's
channel-last layout, the 1024x4096 decode step) and the mamba mixer on CUDA are marked ``gpu``
(``pytest -m gpu`` on a CUDA machine). Without CUDA every test here runs on CPU; with CUDA the
unmarked tests run on the GPU too.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import dtype_id, forced_config, gpu, mixer_runs_with_reference_ops
from torch import nn

import kernels
from mixers.common import causal_conv1d as mixer_causal_conv1d
from mixers.common import causal_conv1d_step as mixer_causal_conv1d_step

# ``kernels.causal_conv1d`` is the public function (it shadows the submodule's name on the
# package), so the kernel module is taken from sys.modules.
cc = sys.modules["kernels.causal_conv1d"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
F32 = torch.float32
F16 = torch.float16


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make_inputs(batch, dim, seqlen, width, dtype, *, bias=True, param_dtype=None):
    """causal_conv1d's tensor inputs as a dict on DEVICE: x (batch, dim, L) in ``dtype``, weight
    (dim, width) scaled like nn.Conv1d's init (fan-in width) and bias in ``param_dtype`` (default
    ``dtype``)."""
    param_dtype = param_dtype or dtype

    def randn(*shape, dt=dtype, std=1.0):
        return (torch.randn(*shape, dtype=F64) * std).to(dt).to(DEVICE)

    inputs = {"x": randn(batch, dim, seqlen), "weight": randn(dim, width, dt=param_dtype, std=width**-0.5)}
    if bias:
        inputs["bias"] = randn(dim, dt=param_dtype, std=0.5)
    return inputs


def identity(x):
    return x


def channel_last(x):
    """The same values in a (batch, L, dim) buffer, viewed as (batch, dim, L): the layout of the
    mixers' in_proj output (time is the strided axis)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def nan_padded(x):
    """The same values as a window of a larger buffer holding NaN all around (a step before t = 0,
    steps past L, channels in between, another sequence): time stays contiguous, so the register
    window runs, and a read outside the window would surface as NaN. Differentiable in x."""
    batch, dim, seqlen = x.shape
    buf = torch.full((batch + 1, 2 * dim + 1, seqlen + 9), math.nan, dtype=x.dtype, device=x.device)
    window = (slice(1, None), slice(1, None, 2), slice(1, 1 + seqlen))
    buf[window] = x
    return buf[window]


LAYOUTS = {"contiguous": identity, "channel_last": channel_last, "nan_padded": nan_padded}


def run(backend, inputs, activation, dy, layout=identity):
    """(y, {name: grad}) of the conv; ``layout`` rearranges x's memory (differentiably) before the
    call; the gradients are those of sum(y * dy)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    args = {**leaves, "x": layout(leaves["x"])}
    y = kernels.causal_conv1d(**args, activation=activation, backend=backend)
    grads = torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype))
    return y, dict(zip(leaves, grads, strict=True))


def rounding_atol(x_ref, dtype):
    """Two units in the last place of dtype at the largest magnitude of x_ref: ``2 eps max|x|``."""
    return 2 * torch.finfo(dtype).eps * x_ref.abs().max().item()


def assert_conv_accuracy(inputs, activation, *, layout=identity):
    """Kernel vs float64 reference, bounded by the naive same-dtype error (see module docstring)."""
    dtype = inputs["x"].dtype
    dy = torch.randn(inputs["x"].shape, dtype=F64).to(dtype).to(DEVICE)
    y, grads = run("triton", inputs, activation, dy, layout)
    assert y.dtype == dtype and y.shape == inputs["x"].shape and y.is_contiguous()
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype and g.shape == inputs[name].shape, name
    got = {"y": y, **grads}
    for name, t in got.items():
        assert torch.isfinite(t).all(), f"{name} has non-finite values"

    ref_y, ref_grads = run("reference", {k: v.double() for k, v in inputs.items()}, activation, dy.double())
    want = {"y": ref_y, **ref_grads}
    if dtype == F64:
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
        return
    naive_y, naive_grads = run("reference", inputs, activation, dy)
    naive = {"y": naive_y, **naive_grads}
    for name in got:
        factor = 2 if name == "y" else 3
        x_dtype = got[name].dtype
        err = (got[name].double() - want[name]).abs().max().item()
        base_err = (naive[name].double() - want[name]).abs().max().item()
        atol = rounding_atol(want[name], x_dtype)
        if got[name].is_cuda and x_dtype == F32 and activation == "silu":
            atol += 2.0**-18 * want[name].abs().max().item()
        assert err <= factor * base_err + atol, (
            f"{name}: kernel error {err:.3g} > {factor} x naive {x_dtype} error {base_err:.3g} + atol {atol:.3g}"
        )


@contextlib.contextmanager
def algorithm(name):
    """Force the register-window ("window") or shifted-load ("shifted") algorithm."""
    saved = cc._register_window
    cc._register_window = (lambda *tensors: True) if name == "window" else (lambda *tensors: False)
    try:
        yield
    finally:
        cc._register_window = saved


# ----------------------------------------------------------------------------------------------
# Accuracy: every kind of case once, at tiny sizes
# ----------------------------------------------------------------------------------------------

LENGTHS = (1, 17, 65, 127)
WIDTHS = (2, 3, 4)
OPTIONS = list(itertools.product((True, False), ("silu", None), (F32, F16)))  # (bias, activation, dtype)
# Every length against every width, the option sets taken in turn (all 8 appear); dim 13 = one full
# and one partial channel block of the interpreter's 8, dim 5 = one partial block.
CASES = [
    (1 + (seqlen == 65), 13 if seqlen == 17 else 5, seqlen, width, *OPTIONS[n % len(OPTIONS)])
    for n, (seqlen, width) in enumerate(itertools.product(LENGTHS, WIDTHS))
]


@pytest.mark.parametrize(
    "batch,dim,seqlen,width,bias,activation,dtype",
    CASES,
    ids=[f"B{c[0]}-d{c[1]}-L{c[2]}-W{c[3]}-bias{int(c[4])}-{c[5]}-{dtype_id(c[6])}" for c in CASES],
)
def test_matches_reference(batch, dim, seqlen, width, bias, activation, dtype):
    assert_conv_accuracy(make_inputs(batch, dim, seqlen, width, dtype, bias=bias), activation)


@pytest.mark.parametrize(
    "bias,activation,dtype", OPTIONS, ids=[f"bias{int(b)}-{a}-{dtype_id(d)}" for b, a, d in OPTIONS]
)
def test_every_option_set_at_width_4(bias, activation, dtype):
    # Mamba's width, across a segment boundary (16) with a lone step past it.
    assert_conv_accuracy(make_inputs(1, 6, 17, 4, dtype, bias=bias), activation)


@pytest.mark.parametrize("width", [1, 5, 6, 9])
def test_any_width_float64(width):
    # Widths outside Mamba's 2-4: a lone tap, and taps wider than the interpreter's chunk of 8
    # (the register window's chunk grows to 16), through both algorithms.
    inputs = make_inputs(1, 5, 21, width, F64)
    for name in ("window", "shifted"):
        with algorithm(name):
            assert_conv_accuracy(inputs, "silu")


def test_mixed_dtypes_and_outputs():
    # Under autocast the mixers pass 16-bit x with fp32 taps and bias: y in x's dtype, each
    # gradient in its input's dtype, as accurate as the naive path.
    inputs = make_inputs(2, 5, 19, 4, F16, param_dtype=F32)
    assert_conv_accuracy(inputs, "silu")
    y = kernels.causal_conv1d(**inputs, activation="silu", backend="triton")
    assert y.dtype == F16


# ----------------------------------------------------------------------------------------------
# Algorithms, layouts, memory discipline, edge cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["window", "shifted"])
def test_algorithms_on_every_layout(name, layout):
    # Both algorithms are correct on any strides (the host only picks the faster one): float64
    # against the reference at 1e-12, with NaN all around the window for "nan_padded".
    inputs = make_inputs(2, 9, 19, 4, F64)
    with algorithm(name):
        assert_conv_accuracy(inputs, "silu", layout=LAYOUTS[layout])


def test_host_picks_the_algorithm_from_the_strides(monkeypatch):
    picked = []
    launch = cc._launch_meta

    def spy(*args):
        meta = launch(*args)
        picked.append(meta["meta"]["REG_WINDOW"])
        return meta

    monkeypatch.setattr(cc, "_launch_meta", spy)
    x = torch.randn(1, 4, 9, device=DEVICE)
    w = torch.randn(4, 3, device=DEVICE)
    for layout in (identity, channel_last, nan_padded):
        kernels.causal_conv1d(layout(x), w, backend="triton")
    assert picked == [True, False, True]


def test_channel_last_16bit_accuracy():
    # The mixers' layout (x a view of in_proj's (B, L, 2 d_inner) output) in fp16, with fp32 taps.
    assert_conv_accuracy(make_inputs(2, 9, 19, 4, F16, param_dtype=F32), "silu", layout=channel_last)


@pytest.mark.parametrize("dy_layout", ["expanded", "channel_last"])
def test_output_gradient_of_any_strides(dy_layout):
    # y.sum() backpropagates an expanded all-ones gradient (every stride 0); a channel-last one
    # sends the backward to the shifted loads. Both match the reference.
    inputs = make_inputs(2, 5, 21, 3, F64)
    dy = channel_last(torch.randn(2, 5, 21, dtype=F64, device=DEVICE))
    results = []
    for backend in ("triton", "reference"):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        y = kernels.causal_conv1d(**leaves, activation="silu", backend=backend)
        loss = y.sum() if dy_layout == "expanded" else (y * dy).sum()
        results.append(torch.autograd.grad(loss, list(leaves.values())))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def nan_filled(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        out = factory(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    return wrapper


@pytest.mark.parametrize("name", ["window", "shifted"])
def test_outputs_fully_written_and_deterministic(monkeypatch, name):
    # Every buffer the kernels allocate (y, dx, the dweight / dbias partials) starts as NaN: an
    # element no program stored would surface. No atomics: results are bitwise equal run to run
    # and to the un-poisoned run.
    inputs = make_inputs(2, 9, 21, 4, F32)
    dy = torch.randn(2, 9, 21, device=DEVICE)
    with algorithm(name):
        clean = run("triton", inputs, "silu", dy)
        again = run("triton", inputs, "silu", dy)
        if DEVICE == "cuda":  # also leave NaN in the caching allocator's free blocks
            junk = [torch.full((1 << 20,), math.nan, device=DEVICE) for _ in range(8)]
            del junk
        monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
        monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
        poisoned = run("triton", inputs, "silu", dy)
        monkeypatch.undo()
    for results in (again, poisoned):
        assert torch.equal(results[0], clean[0])
        for key in inputs:
            assert torch.equal(results[1][key], clean[1][key]), key
    assert all(torch.isfinite(g).all() for g in clean[1].values())


def test_inference_builds_no_graph(monkeypatch):
    # No grad mode, or no input requiring grad: the kernel runs without the autograd Function.
    applied = []
    apply = cc._CausalConv1dFunction.apply
    monkeypatch.setattr(cc._CausalConv1dFunction, "apply", lambda *a: applied.append(1) or apply(*a))
    inputs = make_inputs(1, 3, 9, 4, F32)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    with torch.no_grad():
        y_inference = kernels.causal_conv1d(**leaves, activation="silu", backend="triton")
    y_plain = kernels.causal_conv1d(**inputs, activation="silu", backend="triton")
    y_train = kernels.causal_conv1d(**leaves, activation="silu", backend="triton")
    assert len(applied) == 1
    assert y_inference.grad_fn is None and y_plain.grad_fn is None and y_train.grad_fn is not None
    assert torch.equal(y_inference, y_train) and torch.equal(y_plain, y_train)


@pytest.mark.parametrize("shape", [(2, 4, 0), (0, 4, 5), (2, 0, 5)], ids=["L0", "batch0", "dim0"])
def test_empty_inputs(shape):
    # Nothing to convolve: empty outputs, zero weight and bias gradients.
    batch, dim, seqlen = shape
    inputs = make_inputs(batch, dim, seqlen, 3, F64)
    y, grads = run("triton", inputs, "silu", torch.randn(shape, dtype=F64, device=DEVICE))
    assert y.shape == shape and grads["x"].shape == shape
    assert torch.equal(grads["weight"], torch.zeros(dim, 3, dtype=F64, device=DEVICE))
    assert torch.equal(grads["bias"], torch.zeros(dim, dtype=F64, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# Decode update
# ----------------------------------------------------------------------------------------------


def update_inputs(batch, dim, width, dtype, *, state_dtype=F32, bias=True):
    return dict(
        x=torch.randn(batch, dim, dtype=F64).to(dtype).to(DEVICE),
        conv_state=torch.randn(batch, dim, width, dtype=F64).to(state_dtype).to(DEVICE),
        weight=torch.randn(dim, width, dtype=F64).to(dtype).to(DEVICE),
        **({"bias": torch.randn(dim, dtype=F64).to(dtype).to(DEVICE)} if bias else {}),
    )


@pytest.mark.parametrize(
    "dtype,state_dtype,width,bias,activation,strided",
    [
        (F64, F64, 4, True, "silu", False),
        (F64, F64, 3, False, None, True),
        (F64, F32, 2, True, None, False),  # the window rounds x to its dtype
        (F32, F32, 4, True, "silu", True),
        (F16, F32, 4, True, "silu", False),  # the mixers' 16-bit models: fp32 window
        (F32, F32, 1, True, None, False),
    ],
    ids=["fp64", "fp64-strided-W3", "fp64-fp32state-W2", "fp32-strided", "fp16-fp32state", "fp32-W1"],
)
def test_update_matches_reference(dtype, state_dtype, width, bias, activation, strided):
    inputs = update_inputs(3, 11, width, dtype, state_dtype=state_dtype, bias=bias)
    if strided:  # a window that is a view (every other channel of a larger cache)
        big = torch.randn(3, 22, width, device=DEVICE, dtype=state_dtype)
        big[:, ::2] = inputs["conv_state"]
        inputs["conv_state"] = big[:, ::2]
        untouched = big[:, 1::2].clone()
    ref_inputs = {k: v.clone() for k, v in inputs.items()}
    y = kernels.causal_conv1d_update(**inputs, activation=activation, backend="triton")
    y_ref = kernels.causal_conv1d_update(**ref_inputs, activation=activation, backend="reference")
    assert y.dtype == dtype and y.shape == (3, 11) and inputs["conv_state"].dtype == state_dtype
    if strided:
        assert torch.equal(big[:, 1::2], untouched)  # the other channels stay as they were
    # The window is moved, not computed: bitwise equal.
    assert torch.equal(inputs["conv_state"], ref_inputs["conv_state"])
    if y.dtype == F64:
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    else:
        # The same fp32 products summed in another order; a 16-bit output may round one ulp apart.
        tol = 1e-5 if dtype == F32 else 2 * 2.0**-10
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)


def test_update_wide_windows():
    # Up to width 64 the shift tile shrinks BLOCK_D (it was (256, W, W): past Triton's 2^20 elements
    # from width 128); wider is refused with the way out, not an error from inside Triton.
    inputs = update_inputs(2, 5, 64, F64)
    ref_inputs = {k: v.clone() for k, v in inputs.items()}
    y = kernels.causal_conv1d_update(**inputs, backend="triton")
    y_ref = kernels.causal_conv1d_update(**ref_inputs, backend="reference")
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(inputs["conv_state"], ref_inputs["conv_state"])
    wide = update_inputs(2, 5, 65, F64)
    with pytest.raises(ValueError, match=r"supports width up to 64, got 65; use backend='reference'"):
        kernels.causal_conv1d_update(**wide, backend="triton")
    assert kernels.causal_conv1d_update(**wide, backend="reference").shape == (2, 5)


@pytest.mark.parametrize("prefix", [0, 2, 9])
@pytest.mark.parametrize("width", [3, 4])
def test_prefill_then_updates_equal_full_forward(prefix, width):
    # The forward over a prefix, its last `width` inputs as the window (zeros before t = 0), then
    # one update per token: the outputs of one forward over everything (float64, so any indexing
    # slip shows), and the window ends as the last `width` inputs.
    inputs = make_inputs(2, 5, 14, width, F64)
    x = inputs["x"]
    full = kernels.causal_conv1d(**inputs, activation="silu", backend="triton")
    head = kernels.causal_conv1d(x[..., :prefix], inputs["weight"], inputs["bias"], "silu", backend="triton")
    state = F.pad(x[..., :prefix], (width, 0))[..., -width:].clone()  # (2, 5, width)
    steps = [
        kernels.causal_conv1d_update(
            x[..., t], state, inputs["weight"], inputs["bias"], "silu", backend="triton"
        )
        for t in range(prefix, 14)
    ]
    torch.testing.assert_close(torch.cat([head, torch.stack(steps, -1)], -1), full, rtol=1e-12, atol=1e-12)
    assert torch.equal(state, x[..., -width:])


@pytest.mark.parametrize("dtype", [F64, F32], ids=dtype_id)
def test_mixer_cache_path_through_triton(monkeypatch, dtype):
    # mixers.common with the kernels forced to Triton: chunked prefill (the cached window prepended)
    # and decode steps, starting from a fresh cache, equal the full conv; the window the cache holds
    # (float32 for fp32 models, float64 for float64) is the reference backend's, bitwise.
    conv = nn.Conv1d(6, 6, 4, groups=6).to(DEVICE, dtype)
    x = torch.randn(2, 6, 15, device=DEVICE, dtype=dtype)
    ops = {op: getattr(kernels, op) for op in ("causal_conv1d", "causal_conv1d_update")}
    results = []
    for backend in ("triton", "reference"):
        for op, fn in ops.items():
            monkeypatch.setattr(kernels, op, functools.partial(fn, backend=backend))
        with torch.no_grad():
            full = mixer_causal_conv1d(x, conv, activation="silu")
            state = torch.zeros(2, 6, 4, device=DEVICE, dtype=dtype)
            outs = [mixer_causal_conv1d(x[..., :2], conv, state, activation="silu"),
                    mixer_causal_conv1d(x[..., 2:9], conv, state, activation="silu")]  # fmt: skip
            outs += [mixer_causal_conv1d_step(x[..., t], conv, state, activation="silu")[..., None]
                     for t in range(9, 15)]  # fmt: skip
        results.append((full, torch.cat(outs, -1), state))
        monkeypatch.undo()
    (full, chunked, state), (full_ref, chunked_ref, state_ref) = results
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full, full_ref, **tol)
    torch.testing.assert_close(chunked, full, **tol)
    torch.testing.assert_close(chunked_ref, full_ref, **tol)
    assert torch.equal(state, state_ref) and torch.equal(state, x[..., -4:].to(state.dtype))


# ----------------------------------------------------------------------------------------------
# Dispatch and errors
# ----------------------------------------------------------------------------------------------


def test_registered_for_triton_backend():
    assert kernels._TRITON_OPS["causal_conv1d"] is cc.causal_conv1d
    assert kernels._TRITON_OPS["causal_conv1d_update"] is cc.causal_conv1d_update
    inputs = make_inputs(1, 3, 5, 4, F32)
    expected = "triton" if DEVICE == "cuda" else "reference"
    assert torch.equal(kernels.causal_conv1d(**inputs), kernels.causal_conv1d(**inputs, backend=expected))
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.causal_conv1d(**inputs, backend="cuda")


def _call(op, backend, *args, **kwargs):
    try:
        getattr(kernels, op)(*args, backend=backend, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def _t(*shape, dtype=F32):
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _conv_args(**overrides):
    return dict(x=_t(2, 4, 6), weight=_t(4, 3), bias=_t(4)) | overrides


@pytest.mark.parametrize(
    "kwargs",
    [
        _conv_args(x=_t(4, 6)),  # x not 3-D
        _conv_args(x=[1.0]),
        _conv_args(x=torch.ones(2, 4, 6, dtype=torch.int64, device=DEVICE)),
        _conv_args(weight=_t(4, 1, 3)),  # nn.Conv1d's (dim, 1, width) layout
        _conv_args(weight=_t(5, 3)),  # weight not (dim, width)
        _conv_args(weight=_t(4, 0)),  # width 0
        _conv_args(bias=_t(5)),
        _conv_args(bias=_t(4, 1)),
        _conv_args(bias=_t(4, dtype=F64)),  # bias of another dtype than weight
        _conv_args(activation="relu"),
        _conv_args(activation="swish"),
        _conv_args(activation=True),
    ],
    ids=["x2d", "xlist", "xint", "w3d", "wdim", "w0", "bdim", "b2d", "bdtype", "relu", "swish", "actbool"],
)
def test_errors_identical_to_reference(kwargs):
    triton_error = _call("causal_conv1d", "triton", **kwargs)
    reference_error = _call("causal_conv1d", "reference", **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


def _update_args(**overrides):
    return dict(x=_t(2, 4), conv_state=_t(2, 4, 3), weight=_t(4, 3), bias=_t(4)) | overrides


@pytest.mark.parametrize(
    "kwargs",
    [
        _update_args(x=_t(2, 4, 1)),
        _update_args(conv_state=_t(2, 4)),
        _update_args(conv_state=_t(2, 4, 4)),  # window wider than the taps
        _update_args(conv_state=_t(3, 4, 3)),
        _update_args(conv_state=torch.ones(2, 4, 3, dtype=torch.int32, device=DEVICE)),
        _update_args(weight=_t(5, 3)),
        _update_args(weight=_t(4, 0), conv_state=_t(2, 4, 0)),
        _update_args(bias=_t(4, dtype=torch.float16)),
        _update_args(activation="gelu"),
        _update_args(conv_state=_t(1, 4, 3).expand(2, 4, 3)),  # rows sharing memory
    ],
    ids=[
        "x3d",
        "state2d",
        "state-width",
        "state-batch",
        "state-int",
        "wdim",
        "w0",
        "bdtype",
        "gelu",
        "expanded",
    ],
)
def test_update_errors_identical_to_reference(kwargs):
    triton_error = _call("causal_conv1d_update", "triton", **kwargs)
    reference_error = _call("causal_conv1d_update", "reference", **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


def test_wide_taps_run_the_shifted_loads():
    # Past MAX_REGISTER_WINDOW_WIDTH taps a time-contiguous x takes the shifted loads (the register
    # window's tap tile grows as width^2; at 33 taps it exceeded Triton's largest tensor). One tap
    # past the limit: the shifted backward unrolls width^2 loads, and at 33 fp64 taps compiling it
    # for the H200 took over 4 minutes.
    width = cc.MAX_REGISTER_WINDOW_WIDTH + 1
    assert not cc._register_window(width, _t(1, 4, 20)) and cc._register_window(4, _t(1, 4, 20))
    x, w, b = (
        _t(2, 4, 40, dtype=F64).requires_grad_(),
        _t(4, width, dtype=F64).requires_grad_(),
        _t(4, dtype=F64),
    )
    y = kernels.causal_conv1d(x, w, b, activation="silu", backend="triton")
    y_ref = kernels.causal_conv1d(x, w, b, activation="silu", backend="reference")
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), dy)
    grads_ref = torch.autograd.grad(y_ref, (x, w), dy)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_backend_specific_errors():
    with pytest.raises(RuntimeError, match="not differentiable.*torch.no_grad"):
        kernels.causal_conv1d_update(**_update_args(weight=_t(4, 3).requires_grad_()), backend="triton")
    with torch.no_grad():  # fine without grad mode
        kernels.causal_conv1d_update(**_update_args(weight=_t(4, 3).requires_grad_()), backend="triton")
    if DEVICE == "cpu":
        meta = torch.empty(4, 3, device="meta")
        with pytest.raises(ValueError, match="one device"):
            kernels.causal_conv1d(**_conv_args(weight=meta), backend="triton")
        with pytest.raises(ValueError, match="one device"):
            kernels.causal_conv1d_update(**_update_args(weight=meta), backend="triton")


# ----------------------------------------------------------------------------------------------
# GPU: the full sweep, bf16, realistic shapes, autotune configs, the mamba mixer (pytest -m gpu)
# ----------------------------------------------------------------------------------------------

GPU_LENGTHS = [1, 2, 7, 8, 31, 33, 64, 65, 127, 256, 257, 1000, 2049]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, F16], ids=dtype_id)
@pytest.mark.parametrize("width", [2, 3, 4])
def test_gpu_sweep(dtype, width):
    # Every length x bias x activation x layout for this (dtype, width); dim 200 = one full and
    # one partial block of 128 channels.
    for seqlen, bias, activation, layout in itertools.product(
        GPU_LENGTHS, (True, False), ("silu", None), ("contiguous", "channel_last")
    ):
        inputs = make_inputs(2, 200, seqlen, width, dtype, bias=bias)
        try:
            assert_conv_accuracy(inputs, activation, layout=LAYOUTS[layout])
        except AssertionError as exc:
            raise AssertionError(f"L={seqlen} bias={bias} act={activation} {layout}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32], ids=dtype_id)
@pytest.mark.parametrize(
    "batch,dim,seqlen,layout",
    [(32, 2048, 2048, "contiguous"), (8, 1536, 1000, "channel_last"), (1, 4096, 4097, "contiguous")],
)
def test_gpu_realistic_shapes(dtype, batch, dim, seqlen, layout):
    # The benchmark's shape and the mamba mixer's: 16-bit activations with fp32 taps and bias.
    inputs = make_inputs(batch, dim, seqlen, 4, dtype, param_dtype=F32)
    assert_conv_accuracy(inputs, "silu", layout=LAYOUTS[layout])


@pytest.mark.gpu
@gpu
def test_gpu_float64_and_wide_taps():
    for seqlen, width, layout in itertools.product(
        [1, 33, 300], [1, 4, 7, 12], ["contiguous", "channel_last"]
    ):
        assert_conv_accuracy(make_inputs(2, 64, seqlen, width, F64), "silu", layout=LAYOUTS[layout])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32], ids=dtype_id)
def test_gpu_every_autotune_config(dtype):
    # A config the autotuner may pick on another shape or run must be correct too.
    for index in range(len(cc.causal_conv1d_fwd_kernel.configs)):
        with forced_config((cc.causal_conv1d_fwd_kernel, cc.causal_conv1d_bwd_kernel), index):
            for seqlen, layout in [(1000, "contiguous"), (777, "channel_last")]:
                inputs = make_inputs(2, 640, seqlen, 4, dtype, param_dtype=F32)
                try:
                    assert_conv_accuracy(inputs, "silu", layout=LAYOUTS[layout])
                except AssertionError as exc:
                    raise AssertionError(f"config #{index}, L={seqlen} {layout}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32], ids=dtype_id)
def test_gpu_decode_update_large_batch(dtype):
    # The benchmark's decode shape: batch 1024, dim 4096, width 4, an fp32 window (64 MB).
    inputs = update_inputs(1024, 4096, 4, dtype)
    inputs["weight"], inputs["bias"] = inputs["weight"].float(), inputs["bias"].float()
    ref = {k: v.clone() for k, v in inputs.items()}
    y = kernels.causal_conv1d_update(**inputs, activation="silu")
    y_ref = kernels.causal_conv1d_update(**ref, activation="silu", backend="reference")
    assert torch.equal(inputs["conv_state"], ref["conv_state"])
    tol = 1e-5 if dtype == F32 else 2 * 2.0**-8
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32], ids=dtype_id)
def test_gpu_decode_update_wide_windows(dtype):
    # Widths 9-64 launch with BLOCK_D shrunk (UPDATE_TILE) on a compiled kernel: every width class.
    for width in (5, 9, 16, 17, 33, 64):
        inputs = update_inputs(64, 1000, width, dtype)
        ref = {k: v.clone() for k, v in inputs.items()}
        y = kernels.causal_conv1d_update(**inputs, activation="silu")
        y_ref = kernels.causal_conv1d_update(**ref, activation="silu", backend="reference")
        assert torch.equal(inputs["conv_state"], ref["conv_state"]), width
        # fp32 products summed in another order over up to 64 taps; bf16 output within 2 ulp.
        tol = 1e-5 if dtype == F32 else 2 * 2.0**-8
        torch.testing.assert_close(
            y.float(), y_ref.float(), rtol=tol, atol=tol, msg=lambda m, w=width: f"width {w}: {m}"
        )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("settings", [dict(), dict(d_state=8, d_conv=3, expand=1)], ids=["default", "small"])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=dtype_id)
def test_gpu_mamba_mixer_matches_reference_conv(monkeypatch, settings, dtype):
    # The mixer calls the conv ops with backend=None: the Triton kernels on CUDA. Same mixer and
    # input with the conv's reference forced: the forward, every parameter gradient, prefill +
    # token-by-token decode and the cached windows agree.
    from mixers import build_mixer

    mixer = build_mixer("mamba", 256, **settings).to(DEVICE, dtype)
    x = torch.randn(2, 300, 256, device=DEVICE, dtype=dtype)
    results = mixer_runs_with_reference_ops(
        monkeypatch, mixer, x, ("causal_conv1d", "causal_conv1d_update"), ("conv_state",), prefill=280
    )
    (y_tr, g_tr, dec_tr, conv_tr), (y_ref, g_ref, dec_ref, conv_ref) = results
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == F32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y_tr, y_ref, **tol)
    torch.testing.assert_close(dec_tr, dec_ref, **tol)
    torch.testing.assert_close(dec_tr, y_tr, **tol)  # decode path == full forward
    assert torch.equal(conv_tr, conv_ref)  # the window holds inputs, not results
    for a, b in zip(g_tr, g_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)
