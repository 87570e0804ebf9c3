"""The selective-scan Triton kernels (kernels/selective_scan.py) against the reference.

Accuracy rule (flash-attention's, as in test_flash_attention.py): with the float64 reference on the
same (dtype-rounded) inputs as ground truth,

    err(kernel in dtype X)  <=  2 * err(naive scan in dtype X) + atol   (y, last state)
                                3 * ...                             (every gradient)

where "naive" is the reference itself run on the X inputs: a plain loop over time in float32 (the
precision the kernel accumulates in; for 16-bit X both round the results to X the same way), its
gradients from the hand-written reverse loop. ``atol = 2 eps(X) max|x|`` is two units in the last
place of X at the values' magnitude (flash-attn's rounding atol, in closed form); it matters where
both errors are a rounding or two, and the naive one happens to be the smaller. On the GPU, ``tl.exp2`` is ``ex2.approx`` (relative error about 2^-22 per decay,
compounding over the tens of steps a state remembers), which the naive path's exact ``exp`` lacks:
fp32 runs there allow 2^-18 of the values' magnitude on top. float64 runs are compared with the
reference at 1e-12.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with
chunks of 4 steps and checkpoints every 8, so the tiny cases below span several chunks and
checkpoint segments and cover every *kind* of case once: lengths 1, 7, 64, 65, 300; N = 1, 4, 16, 32;
grouped B/C (including one channel per group); with and without D, z, delta_bias, softplus and an
initial state; very negative A with large dt (every decay underflows) and dt near 0; prefill +
step-by-step decode; two calls with a carried state (gradients through it too); the forward and
the backward cut into sequence parts; NaN past the end of the inputs; NaN-poisoned buffers;
non-contiguous inputs and output gradients; empty sequences and batches; errors. The full
product, bf16 and realistic shapes (the CUDA chunk sizes and each autotune config forced in turn),
and the mamba mixer on CUDA are marked ``gpu`` (``pytest -m gpu`` on a CUDA machine). Without
CUDA every test here runs on CPU; with CUDA the unmarked tests run on the GPU too.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch
from helpers import (
    dtype_id,
    forced_config,
    gpu,
    mixer_runs_with_reference_ops,
    record_step_plans,
    same_layout,
)

import kernels
from kernels import reference

# ``kernels.selective_scan`` is the public function (it shadows the submodule's name on the
# package), so the kernel module is taken from sys.modules.
ss = sys.modules["kernels.selective_scan"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make_inputs(
    batch,
    dim,
    seqlen,
    d_state,
    dtype,
    *,
    groups=None,
    extras=("D", "z", "delta_bias"),
    init=False,
    param_dtype=None,
    A_range=(-1.1, -0.1),
    delta_mean=0.0,
    delta_std=1.0,
    softplus=True,
):
    """selective_scan's tensor inputs as a dict, on DEVICE, Mamba-like: A in ``A_range``; u, delta,
    z, B, C (and the initial state) in ``dtype``; A, D, delta_bias in ``param_dtype`` (default
    ``dtype``), as the mamba mixer passes them; ``extras`` picks the optional ones.

    Without softplus, delta (+ delta_bias) is the step size dt itself and is drawn positive, as in
    Mamba and the reference's tests: a negative step turns a decay into exponential growth, where
    any float32 scan's error grows with the state and a comparison says nothing about the kernel.
    """
    param_dtype = param_dtype or dtype
    bc = (batch, d_state, seqlen) if groups is None else (batch, groups, d_state, seqlen)
    lo, hi = A_range

    def randn(*shape, dt=dtype, mean=0.0, std=1.0):
        return (torch.randn(*shape, dtype=F64) * std + mean).to(dt).to(DEVICE)

    inputs = {
        "u": randn(batch, dim, seqlen),
        "delta": randn(batch, dim, seqlen, mean=delta_mean, std=delta_std),
        "A": (torch.rand(dim, d_state, dtype=F64) * (hi - lo) + lo).to(param_dtype).to(DEVICE),
        "B": randn(*bc),
        "C": randn(*bc),
        "D": randn(dim, dt=param_dtype),
        "z": randn(batch, dim, seqlen),
        "delta_bias": randn(dim, dt=param_dtype, std=0.5),
    }
    if not softplus:
        inputs["delta"], inputs["delta_bias"] = inputs["delta"].abs(), inputs["delta_bias"].abs()
    inputs = {k: v for k, v in inputs.items() if k in ("u", "delta", "A", "B", "C") or k in extras}
    if init:
        state_dtype = F64 if dtype == F64 else torch.float32
        inputs["initial_state"] = randn(batch, dim, d_state, dt=state_dtype)
    return inputs


def run(backend, inputs, softplus, weights):
    """(y, last_state, {name: grad}) of the scan; gradients of sum(y * wy) + sum(last * wl)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y, last = kernels.selective_scan(
        **leaves, delta_softplus=softplus, return_last_state=True, backend=backend
    )
    wy, wl = weights
    loss = (y * wy.to(y.dtype)).sum() + (last * wl.to(last.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, last, dict(zip(leaves, grads, strict=True))


def rounding_atol(x_ref, dtype):
    """Two units in the last place of dtype at the largest magnitude of x_ref: ``2 eps max|x|``.

    flash-attn estimates the same step as ``2 |(x + 0.3) - 0.3 - x|``, which can come out 0 on the
    few elements of dD or d delta_bias; the closed form does not.
    """
    return 2 * torch.finfo(dtype).eps * x_ref.abs().max().item()


def assert_scan_accuracy(inputs, *, softplus=True):
    """Kernel vs float64 reference, bounded by the naive same-dtype error (see module docstring)."""
    dtype = inputs["u"].dtype
    batch, dim, seqlen = inputs["u"].shape
    d_state = inputs["A"].shape[1]
    weights = (
        torch.randn(batch, dim, seqlen, device=DEVICE),
        torch.randn(batch, dim, d_state, device=DEVICE),
    )
    y, last, grads = run("triton", inputs, softplus, weights)
    state_dtype = F64 if dtype == F64 else torch.float32
    assert y.dtype == dtype and y.shape == (batch, dim, seqlen)
    assert last.dtype == state_dtype and last.shape == (batch, dim, d_state)
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype and g.shape == inputs[name].shape, name
    got = {"y": y, "last": last, **grads}
    for name, x in got.items():
        assert torch.isfinite(x).all(), f"{name} has non-finite values"

    ref_y, ref_last, ref_grads = run(
        "reference", {k: v.double() for k, v in inputs.items()}, softplus, [w.double() for w in weights]
    )
    want = {"y": ref_y, "last": ref_last, **ref_grads}
    if dtype == F64:
        for name in got:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
            )
        return
    naive_y, naive_last, naive_grads = run("reference", inputs, softplus, weights)
    naive = {"y": naive_y, "last": naive_last, **naive_grads}
    for name in got:
        factor = 2 if name in ("y", "last") else 3
        x_dtype = got[name].dtype
        err = (got[name].double() - want[name]).abs().max().item()
        base_err = (naive[name].double() - want[name]).abs().max().item()
        atol = rounding_atol(want[name], x_dtype)
        if got[name].is_cuda and x_dtype == torch.float32:
            atol += 2.0**-18 * want[name].abs().max().item()
        assert err <= factor * base_err + atol, (
            f"{name}: kernel error {err:.3g} > {factor} x naive {x_dtype} error {base_err:.3g} + atol {atol:.3g}"
        )


# ----------------------------------------------------------------------------------------------
# Accuracy: every kind of case once, at tiny sizes
# ----------------------------------------------------------------------------------------------

ALL = ("D", "z", "delta_bias")
# (batch, dim, L, N, groups, extras, init, softplus, dtype). The interpreter's chunks are 4 steps,
# its checkpoints every 8 steps and its channel blocks 8 wide.
CASES = [
    (1, 3, 1, 1, None, (), False, False, torch.float32),  # one step, N = 1, nothing optional
    (2, 4, 7, 4, None, ALL, True, True, torch.float32),  # one full and one partial chunk
    (1, 6, 64, 16, 2, ALL, True, True, torch.float32),  # whole segments, N = 16, grouped B/C
    (2, 3, 65, 4, None, ("z",), False, True, torch.float16),  # 16-bit, a lone step past 8 segments
    (1, 2, 300, 4, None, ("D", "delta_bias"), True, True, torch.float32),  # long, not a multiple
    (1, 8, 33, 1, 4, ALL, False, False, torch.float32),  # groups of 2 channels, no softplus
    (1, 6, 9, 32, None, ALL, True, True, torch.float32),  # N = 32: the backward's channel block halves
]


@pytest.mark.parametrize(
    "batch,dim,seqlen,d_state,groups,extras,init,softplus,dtype",
    CASES,
    ids=[
        f"B{c[0]}-d{c[1]}-L{c[2]}-N{c[3]}-G{c[4]}-{'+'.join(c[5]) or 'none'}-h0{int(c[6])}-sp{int(c[7])}-{dtype_id(c[8])}"
        for c in CASES
    ],
)
def test_matches_reference(batch, dim, seqlen, d_state, groups, extras, init, softplus, dtype):
    inputs = make_inputs(
        batch, dim, seqlen, d_state, dtype, groups=groups, extras=extras, init=init, softplus=softplus
    )
    assert_scan_accuracy(inputs, softplus=softplus)


def test_float64_matches_reference():
    # Grouped B/C (3 groups of 2 channels), every option, an initial state, several segments.
    inputs = make_inputs(1, 6, 37, 4, F64, groups=3, extras=ALL, init=True)
    assert_scan_accuracy(inputs)


def test_very_negative_A_and_large_dt():
    # dt A between -3500 and -250: every decay underflows to exactly 0 (h_t = x_t B_t), and delta
    # straddles softplus's threshold of 20, where its value and gradient switch formulas.
    inputs = make_inputs(1, 4, 20, 4, torch.float32, extras=ALL, init=True, A_range=(-100.0, -50.0),
                         delta_mean=20.0, delta_std=5.0)  # fmt: skip
    dt = torch.nn.functional.softplus(inputs["delta"] + inputs["delta_bias"][:, None])
    decays = torch.exp(dt[..., None] * inputs["A"][None, :, None, :])
    assert (decays == 0).all() and (dt > 20).any() and (dt < 20).any()  # the case is the one described
    assert_scan_accuracy(inputs)


def test_dt_near_zero():
    # softplus(-14 +- 0.5) ~ 1e-6: log1p must keep dt's digits (log(1 + e) would round to 0).
    inputs = make_inputs(1, 4, 20, 4, torch.float32, extras=ALL, init=True, delta_mean=-14.0, delta_std=0.5)
    assert_scan_accuracy(inputs)


# ----------------------------------------------------------------------------------------------
# Decode, carried state, padding
# ----------------------------------------------------------------------------------------------


def test_prefill_then_decode_equals_full_scan():
    # Prefill a prefix with the scan, then one selective_state_update per token: the same outputs
    # and final state as one scan over everything (float64, so any indexing slip shows).
    inputs = make_inputs(2, 4, 20, 4, F64, groups=2, extras=ALL, init=True)
    y, last = kernels.selective_scan(**inputs, delta_softplus=True, return_last_state=True, backend="triton")
    prefix = {k: (v[..., :9] if v.shape[-1] == 20 else v) for k, v in inputs.items()}
    y_pre, state = kernels.selective_scan(
        **prefix, delta_softplus=True, return_last_state=True, backend="triton"
    )
    steps = []
    for t in range(9, 20):
        steps.append(
            kernels.selective_state_update(
                state, inputs["u"][..., t], inputs["delta"][..., t], inputs["A"], inputs["B"][..., t],
                inputs["C"][..., t], inputs["D"], inputs["z"][..., t], inputs["delta_bias"], True,
                backend="triton",
            )
        )  # fmt: skip
    torch.testing.assert_close(torch.cat([y_pre, torch.stack(steps, -1)], -1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, last, rtol=1e-12, atol=1e-12)


def test_two_calls_with_carried_state_equal_one():
    # Outputs, last state and every gradient (through the carried state as well) of a scan split
    # at step 13 (inside a chunk and a segment) equal those of one call.
    inputs = make_inputs(1, 4, 30, 4, F64, extras=ALL, init=True)
    weights = (
        torch.randn(1, 4, 30, device=DEVICE, dtype=F64),
        torch.randn(1, 4, 4, device=DEVICE, dtype=F64),
    )
    y, last, grads = run("triton", inputs, True, weights)

    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    first = {k: (v[..., :13] if v.shape[-1] == 30 else v) for k, v in leaves.items()}
    second = {k: (v[..., 13:] if v.shape[-1] == 30 else v) for k, v in leaves.items() if k != "initial_state"}
    y1, state = kernels.selective_scan(**first, delta_softplus=True, return_last_state=True, backend="triton")
    y2, last2 = kernels.selective_scan(
        **second, delta_softplus=True, return_last_state=True, initial_state=state, backend="triton"
    )
    y_split = torch.cat([y1, y2], -1)
    split_grads = torch.autograd.grad(
        (y_split * weights[0]).sum() + (last2 * weights[1]).sum(), list(leaves.values())
    )
    torch.testing.assert_close(y_split, y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last2, last, rtol=1e-12, atol=1e-12)
    for name, g in zip(leaves, split_grads, strict=True):
        torch.testing.assert_close(g, grads[name], rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("init", [False, True], ids=["h0none", "h0"])
def test_forward_in_sequence_parts_equals_one_part(monkeypatch, init):
    # The sequence cut into parts of one checkpoint interval (the last one shorter and ending in a
    # partial chunk): outputs, last state and every gradient (the backward reads the checkpoints
    # each part wrote) equal those of one walk over the whole sequence, in float64.
    steps = ss.CHECKPOINT_STEPS
    seqlen = 3 * steps + steps // 2 + 1
    inputs = make_inputs(2, 4, seqlen, 4, F64, groups=2, extras=ALL, init=init)
    weights = (
        torch.randn(2, 4, seqlen, device=DEVICE, dtype=F64),
        torch.randn(2, 4, 4, device=DEVICE, dtype=F64),
    )
    calls = []

    def parts(n_parts):
        def pick(programs, length, num_sms):
            calls.append(n_parts)
            return n_parts, steps if n_parts > 1 else length

        return pick

    monkeypatch.setattr(ss, "sequence_parts", parts(4))
    y, last, grads = run("triton", inputs, True, weights)
    monkeypatch.setattr(ss, "sequence_parts", parts(1))
    y1, last1, grads1 = run("triton", inputs, True, weights)
    assert calls == [4, 1]
    torch.testing.assert_close(y, y1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, last1, rtol=1e-12, atol=1e-12)
    for name in grads:
        torch.testing.assert_close(
            grads[name], grads1[name], rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
        )


def backward_parts_spy(monkeypatch, part_len=None):
    """The list of the backward's ``(n_parts, part_len)``, one entry per backward call; with
    ``part_len`` (a multiple of CHECKPOINT_STEPS) the backward is cut into parts of that length
    instead of by its rule."""
    calls = []
    rule = ss.backward_sequence_parts

    def pick(programs, seqlen, num_sms):
        if part_len is None:
            split = rule(programs, seqlen, num_sms)
        else:
            split = (-(-max(seqlen, 1) // part_len), part_len)
        calls.append(split)
        return split

    monkeypatch.setattr(ss, "backward_sequence_parts", pick)
    return calls


# The end of the sequence (after 3 checkpoint intervals) in the backward's last part: a lone step
# (a partial chunk alone), a whole chunk and one step, or a whole interval (no partial chunk).
BACKWARD_TAILS = {
    "lone-step": lambda steps: 1,
    "chunk-and-step": lambda steps: steps // 2 + 1,
    "whole": lambda steps: steps,
}


@pytest.mark.parametrize(
    "tail,init,loss",
    [
        ("lone-step", False, "y"),
        ("lone-step", True, "y+last"),
        ("chunk-and-step", True, "y"),
        ("chunk-and-step", False, "y+last"),
        ("chunk-and-step", True, "last"),
        ("whole", True, "y+last"),
    ],
    ids=lambda v: ("h0" if v else "h0none") if isinstance(v, bool) else v,
)
def test_backward_in_sequence_parts_equals_one_part(monkeypatch, tail, init, loss):
    # The backward cut into parts of one checkpoint interval (4 parts; the last one ends the
    # sequence) against one walk over the whole sequence, from the same forward, in fp32: every
    # gradient, with a loss on y alone (no gradient of the last state: return_last_state=False), on
    # y and the last state, and on the last state alone (no gradient of y).
    #
    # Only the association of the arithmetic differs: the state gradient entering an earlier part
    # is decay * g + g_local, with decay one exponential of the part's summed exponent, where one
    # walk carries g through the part's per-step decays (8 steps on the interpreter: at most about
    # 8 + 2 roundings of the carried value, which then decays); and dA, dD, d delta_bias are Kahan
    # sums per part, added across parts and batch elements on the host. So each gradient may move
    # by a few roundings of its largest values: measured at most 5.1 eps max|grad| (78 cases, seeds
    # and shapes like these), bounded here by 16 eps max|grad|; a wrong carry or a lost step moves
    # them by O(max|grad|). On CUDA, exp2 is ex2.approx (about 2^-22 per decay, over 32-step
    # parts), hence the file's 2^-18 on top.
    # dC and dz depend on the states and dy alone, which the parts leave as they are: bitwise equal
    # (one channel block per group here, so each dB / dC element is a single add even with atomics).
    steps = ss.CHECKPOINT_STEPS
    seqlen = 3 * steps + BACKWARD_TAILS[tail](steps)
    inputs = make_inputs(2, 6, seqlen, 3, torch.float32, groups=2, extras=ALL, init=init)
    wy = torch.randn(2, 6, seqlen, device=DEVICE)
    wl = torch.randn(2, 6, 3, device=DEVICE)

    def grads(part_len):
        calls = backward_parts_spy(monkeypatch, part_len)
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        out = kernels.selective_scan(
            **leaves, delta_softplus=True, return_last_state=loss != "y", backend="triton"
        )
        value = {
            "y": lambda: (out * wy).sum(),
            "y+last": lambda: (out[0] * wy).sum() + (out[1] * wl).sum(),
            "last": lambda: (out[1] * wl).sum(),
        }[loss]()
        result = torch.autograd.grad(value, list(leaves.values()))
        return calls, dict(zip(leaves, result, strict=True))

    calls, parts = grads(steps)
    calls1, whole = grads(4 * steps)
    assert calls == [(4, steps)] and calls1 == [(1, 4 * steps)]
    eps = torch.finfo(torch.float32).eps
    for name in inputs:
        if name in ("C", "z"):
            assert torch.equal(parts[name], whole[name]), name
            continue
        scale = whole[name].abs().max().item()
        atol = 16 * eps * scale + (2.0**-18 * scale if DEVICE == "cuda" else 0.0)
        torch.testing.assert_close(
            parts[name], whole[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=dtype_id)
def test_backward_in_sequence_parts_matches_reference(monkeypatch, dtype):
    # 5 parts of one checkpoint interval, the last a partial chunk alone; grouped B/C, every
    # option, an initial state, the last state's gradient: against the float64 reference, with the
    # file's accuracy rule (float64 at 1e-12).
    steps = ss.CHECKPOINT_STEPS
    calls = backward_parts_spy(monkeypatch, steps)
    inputs = make_inputs(2, 6, 4 * steps + 3, 4, dtype, groups=3, extras=ALL, init=True)
    assert_scan_accuracy(inputs)
    assert calls == [(5, steps)]


def test_sequence_parts_rule():
    steps = ss.CHECKPOINT_STEPS
    for rule, programs, seqlen, num_sms in itertools.product(
        [ss.sequence_parts, ss.backward_sequence_parts],
        [1, 2, 96, 10_000],
        [1, 7, 513, 4096, 32768],
        [1, 4, 132],
    ):
        n_parts, part_len = rule(programs, seqlen, num_sms)
        assert part_len % steps == 0 and (n_parts - 1) * part_len < seqlen <= n_parts * part_len
        assert n_parts == 1 or (
            part_len >= ss.MIN_PART_STEPS and programs * n_parts <= ss.PART_TARGET_WARPS * num_sms
        )
    assert ss.sequence_parts(96, 32768, 132)[0] > 1  # a batch-1 prefill of Mamba at d_inner 1536
    assert ss.sequence_parts(1024, 32768, 132)[0] == 1  # a training batch: B8 at d_inner 2048

    def backward_programs(batch, dim, d_state):  # counted at the backward's channel block
        return batch * math.ceil(dim / ss._bwd_block_d(dim, d_state))

    # Mamba at d_inner 1536, N = 16, batch 1 over 32768 steps; a training batch, B8 at d_inner 2048.
    assert ss.backward_sequence_parts(backward_programs(1, 1536, 16), 32768, 132)[0] > 1
    assert ss.backward_sequence_parts(backward_programs(8, 2048, 16), 32768, 132)[0] == 1
    if not torch.cuda.is_available():  # the interpreter's shapes above run in parts
        assert ss.sequence_parts(2, 64, ss.INTERPRET_SMS)[0] > 1
        assert ss.backward_sequence_parts(backward_programs(2, 4, 4), 64, ss.INTERPRET_SMS)[0] > 1


def test_padding_past_the_end_is_never_used():
    # Inputs that are the first L steps of longer buffers holding NaN beyond: the partial last
    # chunk must mask them out (a NaN read into a padded step would reach the state, y or a
    # gradient); every result is bitwise the one of clean contiguous inputs.
    seqlen = 13  # 3 full chunks and 1 step of the interpreter's 4; 4 steps of a CUDA chunk of 8 or 4
    clean = make_inputs(2, 5, seqlen, 4, torch.float32, groups=1, extras=ALL, init=True)
    padded = {}
    for name, t in clean.items():
        if t.shape[-1] == seqlen and t.dim() >= 3:
            buf = torch.full((*t.shape[:-1], seqlen + 11), math.nan, dtype=t.dtype, device=DEVICE)
            buf[..., :seqlen] = t
            padded[name] = buf[..., :seqlen]
        else:
            padded[name] = t
    weights = (torch.randn(2, 5, seqlen, device=DEVICE), torch.randn(2, 5, 4, device=DEVICE))
    want = run("triton", clean, True, weights)
    got = run("triton", padded, True, weights)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in clean:
        assert torch.equal(got[2][name], want[2][name]), name
        assert torch.isfinite(got[2][name]).all(), name


# ----------------------------------------------------------------------------------------------
# Memory discipline, layouts, edge cases
# ----------------------------------------------------------------------------------------------


def nan_filled(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        out = factory(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    return wrapper


@pytest.mark.parametrize("backward_parts", ["rule", "interval-parts"])
def test_outputs_fully_written_and_deterministic(monkeypatch, backward_parts):
    # Every buffer the kernels allocate with torch.empty (outputs, checkpoints, scratch, partials,
    # the backward's per-part maps and sums) starts as NaN: an element a program forgot to store
    # would surface as NaN. Under PyTorch's deterministic mode (per-block dB / dC partials, no
    # atomics) results are bitwise equal run to run and to the un-poisoned run. "interval-parts"
    # cuts the backward into parts of one checkpoint interval (on the interpreter: 8, 8 and 5 steps).
    if backward_parts == "interval-parts":
        backward_parts_spy(monkeypatch, ss.CHECKPOINT_STEPS)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    inputs = make_inputs(2, 10, 21, 4, torch.float32, groups=2, extras=ALL, init=True)
    weights = (torch.randn(2, 10, 21, device=DEVICE), torch.randn(2, 10, 4, device=DEVICE))
    clean = run("triton", inputs, True, weights)
    again = run("triton", inputs, True, weights)
    if DEVICE == "cuda":  # also leave NaN in the caching allocator's free blocks
        junk = [torch.full((1 << 20,), math.nan, device=DEVICE) for _ in range(8)]
        del junk
    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
    poisoned = run("triton", inputs, True, weights)
    monkeypatch.undo()
    for results in (again, poisoned):
        assert torch.equal(results[0], clean[0]) and torch.equal(results[1], clean[1])
        for name in inputs:
            assert torch.equal(results[2][name], clean[2][name]), name
    assert all(torch.isfinite(g).all() for g in clean[2].values())


@pytest.mark.parametrize("backward_parts", ["rule", "interval-parts"])
def test_atomic_dB_dC_equal_the_deterministic_partials(monkeypatch, backward_parts):
    # By default each channel block adds its share of dB / dC atomically (several blocks per group
    # here: 48 channels per group); the sums match the deterministic per-block partials up to the
    # rounding of fp32 adds in another order: n_blocks - 1 adds, each rounding by at most eps times
    # a running sum bounded by the sum of |partials| (at most n_blocks times the largest one, which
    # is of the size of the largest total), hence n_blocks^2 eps max|total|. Every other gradient
    # is bitwise the same. "interval-parts" cuts the backward into parts of one checkpoint interval
    # (on the interpreter: 8 and 5 steps), which add into disjoint steps.
    if backward_parts == "interval-parts":
        backward_parts_spy(monkeypatch, ss.CHECKPOINT_STEPS)
    inputs = make_inputs(1, 96, 13, 4, torch.float32, groups=2, extras=ALL, init=True)
    weights = (torch.randn(1, 96, 13, device=DEVICE), torch.randn(1, 96, 4, device=DEVICE))
    results = {}
    for deterministic in (False, True):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d)
        results[deterministic] = run("triton", inputs, True, weights)
    atomic, partials = results[False], results[True]
    assert torch.equal(atomic[0], partials[0]) and torch.equal(atomic[1], partials[1])
    n_blocks = math.ceil(48 / ss.BWD_BLOCK_D)
    for name in inputs:
        if name in ("B", "C"):
            atol = n_blocks**2 * torch.finfo(torch.float32).eps * partials[2][name].abs().max().item()
            torch.testing.assert_close(atomic[2][name], partials[2][name], rtol=0, atol=atol)
        else:
            assert torch.equal(atomic[2][name], partials[2][name]), name


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_non_contiguous_inputs(layout):
    # (batch, L, dim) buffers viewed as (batch, dim, L), or windows of larger buffers: only the
    # addressing differs, so every result is bitwise the contiguous one.
    inputs = make_inputs(2, 6, 19, 4, torch.float32, groups=2, extras=ALL, init=True)

    def relayout(t):
        if t.dim() == 1:  # D and delta_bias: every other element of a longer vector
            return torch.randn(2 * t.shape[0], device=DEVICE, dtype=t.dtype)[::2].copy_(t)
        if layout == "transposed":
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)
        big = torch.randn(*(s + 3 for s in t.shape), device=DEVICE, dtype=t.dtype)
        view = big[tuple(slice(1, 1 + s) for s in t.shape)]
        return view.copy_(t)

    strided = {k: relayout(v) for k, v in inputs.items()}
    assert all(not v.is_contiguous() for v in strided.values())
    weights = (torch.randn(2, 6, 19, device=DEVICE), torch.randn(2, 6, 4, device=DEVICE))
    want = run("triton", inputs, True, weights)
    got = run("triton", strided, True, weights)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in inputs:
        assert torch.equal(got[2][name], want[2][name]), name


@pytest.mark.parametrize("mixed", [False, True], ids=["channel-last", "mixed"])
def test_mixer_layouts(mixed):
    # The Mamba mixer's buffers: u, delta and dout (batch, L, dim) seen as (batch, dim, L); z the
    # second half of a (batch, L, 2 dim) buffer; B and C slices of one (batch, L, 3 + 2 N) buffer.
    # "mixed" keeps u (in the mixer, the conv's output) and z time-contiguous.
    batch, dim, seqlen, d_state = 2, 6, 19, 4
    inputs = make_inputs(batch, dim, seqlen, d_state, torch.float32, extras=ALL, init=True)
    dout = torch.randn(batch, dim, seqlen, device=DEVICE)
    dlast = torch.randn(batch, dim, d_state, device=DEVICE)

    def channel_last(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    xz = torch.randn(batch, seqlen, 2 * dim, device=DEVICE)
    xz[..., dim:] = inputs["z"].transpose(1, 2)
    bc = torch.randn(batch, seqlen, 3 + 2 * d_state, device=DEVICE)
    bc[..., 3 : 3 + d_state] = inputs["B"].transpose(1, 2)
    bc[..., 3 + d_state :] = inputs["C"].transpose(1, 2)
    strided = {
        **inputs,
        "u": inputs["u"] if mixed else channel_last(inputs["u"]),
        "delta": channel_last(inputs["delta"]),
        "z": inputs["z"] if mixed else xz[..., dim:].transpose(1, 2),
        "B": bc[..., 3 : 3 + d_state].transpose(1, 2),
        "C": bc[..., 3 + d_state :].transpose(1, 2),
    }

    def scan(tensors, dout, dlast, backend="triton"):
        leaves = {k: v.detach().requires_grad_() for k, v in tensors.items()}  # views keep their strides
        y, last = kernels.selective_scan(
            **leaves, delta_softplus=True, return_last_state=True, backend=backend
        )
        grads = torch.autograd.grad((y, last), list(leaves.values()), (dout, dlast))
        return {"y": y, "last": last, **dict(zip(leaves, grads, strict=True))}

    want = scan(inputs, dout, dlast)
    got = scan(strided, channel_last(dout), dlast)
    if DEVICE == "cpu":
        # The interpreter runs the same numpy operations whatever the strides: only the addressing
        # differs, so every result is bitwise the contiguous inputs' one.
        for name in want:
            assert torch.equal(got[name], want[name]), name
        return
    # Compiled, each stride specialisation gets its own thread layouts, so a cross-thread reduction
    # (y's sum over d_state, dA's over time) may add in another order: on the H200 (Triton 3.6,
    # 2026-12-03) "mixed" differed from the contiguous run by 1.1 eps of max|y|, "channel-last" by
    # nothing. So on CUDA the strided run is held to flash-attention's rule with the contiguous run
    # as the baseline: its error against the float64 reference at most 2x the contiguous run's,
    # plus two units in the last place.
    exact = scan({k: v.double() for k, v in inputs.items()}, dout.double(), dlast.double(), "reference")
    for name, x in exact.items():
        err = (got[name].double() - x).abs().max().item()
        base_err = (want[name].double() - x).abs().max().item()
        atol = rounding_atol(x, torch.float32)
        assert err <= 2 * base_err + atol, (
            f"{name}: strided error {err:.3g} > 2 x contiguous {base_err:.3g} + {atol:.3g}"
        )


def test_expanded_output_gradient_and_unused_outputs():
    # y.sum() backpropagates an expanded all-ones gradient (every stride 0); a loss on the last
    # state alone leaves y's gradient None, one on y alone the last state's.
    inputs = make_inputs(1, 4, 11, 4, F64, extras=ALL, init=True)
    ones = torch.ones(1, 4, 11, device=DEVICE, dtype=F64)
    for loss_of in (lambda y, last: y.sum(), lambda y, last: last.sum(), lambda y, last: (y * ones).sum()):
        grads = []
        for backend in ("triton", "reference"):
            leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
            y, last = kernels.selective_scan(
                **leaves, delta_softplus=True, return_last_state=True, backend=backend
            )
            grads.append(torch.autograd.grad(loss_of(y, last), list(leaves.values()), allow_unused=True))
        for a, b in zip(*grads, strict=True):
            if b is None:  # the reference's graph may not reach an input at all (e.g. z from last)
                assert torch.equal(a, torch.zeros_like(a))
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_checkpoints_only_when_a_gradient_is_needed(monkeypatch):
    # Inference (no grad mode, or no input requiring grad) saves no checkpoints and builds no graph.
    calls = []
    forward = ss._forward

    def spy(*args):
        calls.append(args[-1])  # store_ckpt
        return forward(*args)

    monkeypatch.setattr(ss, "_forward", spy)
    inputs = make_inputs(1, 3, 9, 2, torch.float32, extras=ALL)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    with torch.no_grad():
        y_inference = kernels.selective_scan(**leaves, delta_softplus=True, backend="triton")
    y_plain = kernels.selective_scan(**inputs, delta_softplus=True, backend="triton")
    y_train = kernels.selective_scan(**leaves, delta_softplus=True, backend="triton")
    assert calls == [False, False, True]
    assert y_inference.grad_fn is None and y_plain.grad_fn is None and y_train.grad_fn is not None
    assert torch.equal(y_inference, y_train) and torch.equal(y_plain, y_train)


def test_output_dtypes_and_mixed_input_dtypes():
    # The mixer's mix: fp32 A, D, delta_bias with 16-bit u, delta, z, B, C; y in u's dtype, the
    # state in fp32, each gradient in its input's dtype. Without return_last_state: y alone.
    inputs = make_inputs(1, 4, 9, 4, torch.float16, extras=ALL, init=True, param_dtype=torch.float32)
    y, last, grads = run(
        "triton", inputs, True, (torch.randn(1, 4, 9, device=DEVICE), torch.randn(1, 4, 4, device=DEVICE))
    )
    assert y.dtype == torch.float16 and last.dtype == torch.float32
    assert all(grads[k].dtype == inputs[k].dtype for k in inputs)
    alone = kernels.selective_scan(**inputs, delta_softplus=True, backend="triton")
    assert torch.equal(alone, y)
    assert_scan_accuracy(inputs)


def test_empty_sequence_and_batch():
    # L = 0: y is empty, the last state is the initial state, its gradient passes straight through
    # and every other gradient is zero. batch = 0: empty everything.
    inputs = make_inputs(2, 4, 0, 3, F64, extras=ALL, init=True)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    y, last = kernels.selective_scan(**leaves, delta_softplus=True, return_last_state=True, backend="triton")
    assert y.shape == (2, 4, 0) and torch.equal(last, inputs["initial_state"])
    grads = torch.autograd.grad(last.sum() * 2, list(leaves.values()))
    for name, g in zip(leaves, grads, strict=True):
        want = torch.full_like(g, 2.0) if name == "initial_state" else torch.zeros_like(g)
        assert torch.equal(g, want), name
    empty = make_inputs(0, 4, 5, 3, F64, extras=ALL)
    y = kernels.selective_scan(**empty, backend="triton")
    assert y.shape == (0, 4, 5)


# ----------------------------------------------------------------------------------------------
# Decode step
# ----------------------------------------------------------------------------------------------


def step_inputs(batch, dim, d_state, dtype, *, groups=None, state_dtype=torch.float32):
    bc = (batch, d_state) if groups is None else (batch, groups, d_state)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, dtype=F64).to(dt).to(DEVICE)

    return dict(
        state=randn(batch, dim, d_state, dt=state_dtype),
        x=randn(batch, dim),
        dt=randn(batch, dim),
        A=-torch.rand(dim, d_state, dtype=F64, device=DEVICE).to(dtype) - 0.1,
        B=randn(*bc),
        C=randn(*bc),
        D=randn(dim),
        z=randn(batch, dim),
        dt_bias=randn(dim),
    )


@pytest.mark.parametrize(
    "dtype,state_dtype,groups,strided",
    [
        (F64, F64, None, False),
        (F64, F64, 3, True),
        (torch.float32, torch.float32, 2, False),
        (torch.float16, torch.float32, None, True),
    ],
    ids=["fp64", "fp64-grouped-strided", "fp32-grouped", "fp16-strided"],
)
def test_step_matches_reference(dtype, state_dtype, groups, strided):
    inputs = step_inputs(3, 12, 5, dtype, groups=groups, state_dtype=state_dtype)
    if strided:  # a state that is a view (every other channel of a larger cache)
        big = torch.randn(3, 24, 5, device=DEVICE, dtype=state_dtype)
        big[:, ::2] = inputs["state"]
        inputs["state"] = big[:, ::2]
        untouched = big[:, 1::2].clone()
    ref_inputs = {k: v.clone() for k, v in inputs.items()}
    y = kernels.selective_state_update(**inputs, dt_softplus=True, backend="triton")
    y_ref = kernels.selective_state_update(**ref_inputs, dt_softplus=True, backend="reference")
    assert y.dtype == dtype and inputs["state"].dtype == state_dtype
    if strided:
        assert torch.equal(big[:, 1::2], untouched)  # the other channels stay as they were
    if dtype == F64:
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(inputs["state"], ref_inputs["state"], rtol=1e-12, atol=1e-12)
        return
    # One step: the same fp32 products and exponentials, summed over N in another order; a 16-bit
    # output may round one ulp apart.
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-10
    torch.testing.assert_close(inputs["state"], ref_inputs["state"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)


def test_step_options_and_empty_batch():
    # No D / z / bias / softplus; and a batch of 0.
    inputs = step_inputs(2, 4, 3, F64)
    for drop in ({"D", "z", "dt_bias"}, set()):
        args = {k: v.clone() for k, v in inputs.items() if k not in drop}
        ref = {k: v.clone() for k, v in args.items()}
        y = kernels.selective_state_update(**args, backend="triton")
        torch.testing.assert_close(
            y, kernels.selective_state_update(**ref, backend="reference"), rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(args["state"], ref["state"], rtol=1e-12, atol=1e-12)
    empty = step_inputs(0, 4, 3, F64)
    assert kernels.selective_state_update(**empty, backend="triton").shape == (0, 4)


# ----------------------------------------------------------------------------------------------
# Dispatch and errors
# ----------------------------------------------------------------------------------------------


def test_registered_for_triton_backend():
    assert kernels._TRITON_OPS["selective_scan"] is ss.selective_scan
    assert kernels._TRITON_OPS["selective_state_update"] is ss.selective_state_update
    inputs = make_inputs(1, 3, 5, 2, torch.float32, extras=ALL)
    expected = "triton" if DEVICE == "cuda" else "reference"
    assert torch.equal(kernels.selective_scan(**inputs), kernels.selective_scan(**inputs, backend=expected))


def _call(op, backend, *args, **kwargs):
    try:
        getattr(kernels, op)(*args, backend=backend, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _scan_args(**overrides):
    args = dict(u=_t(2, 4, 6), delta=_t(2, 4, 6), A=_t(4, 3), B=_t(2, 3, 6), C=_t(2, 3, 6))
    return args | overrides


@pytest.mark.parametrize(
    "kwargs",
    [
        _scan_args(delta=_t(2, 4, 5)),
        _scan_args(u=_t(4, 6)),
        _scan_args(u=[1.0]),
        _scan_args(delta=torch.ones(2, 4, 6, dtype=torch.int64, device=DEVICE)),
        _scan_args(A=_t(5, 3)),
        _scan_args(A=_t(4)),
        _scan_args(B=_t(2, 3, 5), C=_t(2, 3, 5)),
        _scan_args(B=_t(2, 3, 3, 6), C=_t(2, 3, 3, 6)),
        _scan_args(C=_t(2, 2, 3, 6)),
        _scan_args(B=_t(2, 4, 6), C=_t(2, 4, 6)),
        _scan_args(D=_t(3)),
        _scan_args(z=_t(2, 4, 5)),
        _scan_args(delta_bias=_t(4, 1)),
        _scan_args(initial_state=_t(2, 4, 2)),
        _scan_args(A=_t(4, 0), B=_t(2, 0, 6), C=_t(2, 0, 6)),
        _scan_args(delta_softplus="False"),
        _scan_args(return_last_state=1),
    ],
)
def test_errors_identical_to_reference(kwargs):
    triton_error = _call("selective_scan", "triton", **kwargs)
    reference_error = _call("selective_scan", "reference", **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


def _step_args(**overrides):
    args = dict(state=_t(2, 4, 3), x=_t(2, 4), dt=_t(2, 4), A=_t(4, 3), B=_t(2, 3), C=_t(2, 3))
    return args | overrides


@pytest.mark.parametrize(
    "kwargs",
    [
        _step_args(x=_t(2, 5)),
        _step_args(dt=_t(2, 4, 1)),
        _step_args(A=_t(4, 2)),
        _step_args(B=_t(2, 3, 3), C=_t(2, 3, 3)),
        _step_args(C=_t(2, 4)),
        _step_args(z=_t(4)),
        _step_args(D=_t(5)),
        _step_args(state=torch.ones(2, 4, 3, dtype=torch.int32, device=DEVICE)),
        _step_args(state=_t(1, 4, 3).expand(2, 4, 3)),
        _step_args(state=_t(2, 4, 0), A=_t(4, 0), B=_t(2, 0), C=_t(2, 0)),
        _step_args(dt_bias=_t(5)),
        _step_args(dt_softplus="False"),
    ],
)
def test_step_errors_identical_to_reference(kwargs):
    triton_error = _call("selective_state_update", "triton", **kwargs)
    reference_error = _call("selective_state_update", "reference", **kwargs)
    assert reference_error is not None
    assert triton_error == reference_error


def test_shared_state_memory_and_empty_state_are_refused():
    # An expanded state would be updated in place through aliased rows: silently wrong numbers.
    with pytest.raises(ValueError, match=r"expanded view \(stride 0 along dim 0\); pass state.clone\(\)"):
        kernels.selective_state_update(**_step_args(state=_t(1, 4, 3).expand(2, 4, 3)), backend="triton")
    with pytest.raises(ValueError, match="d_state .* must be >= 1, got 0"):
        kernels.selective_scan(**_scan_args(A=_t(4, 0), B=_t(2, 0, 6), C=_t(2, 0, 6)), backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_flags_must_be_bools_and_errors_name_the_ops_arguments(backend):
    # A string flag is truthy: "False" would silently apply softplus.
    with pytest.raises(TypeError, match="delta_softplus must be True or False, got 'False'"):
        kernels.selective_scan(**_scan_args(delta_softplus="False"), backend=backend)
    with pytest.raises(TypeError, match="return_last_state must be True or False, got 1"):
        kernels.selective_scan(**_scan_args(return_last_state=1), backend=backend)
    with pytest.raises(TypeError, match="dt_softplus must be True or False, got 'False'"):
        kernels.selective_state_update(**_step_args(dt_softplus="False"), backend=backend)
    # The decode step's bias is dt_bias, not selective_scan's delta_bias.
    with pytest.raises(ValueError, match=r"^dt_bias must have shape \(dim,\) = \(4,\), got \(5,\)$"):
        kernels.selective_state_update(**_step_args(dt_bias=_t(5)), backend=backend)
    # A state of another d_state than A's: both shapes named, and the state is the one to fix.
    match = (
        r"state is \(batch, dim, d_state\) = \(2, 4, 3\) with d_state 3, but A is \(dim, d_state\) = "
        r"\(4, 2\) with d_state 2; .*pass a state of shape \(batch, dim, 2\)"
    )
    with pytest.raises(ValueError, match=match):
        kernels.selective_state_update(**_step_args(A=_t(4, 2)), backend=backend)


def test_backend_specific_errors():
    with pytest.raises(RuntimeError, match="not differentiable.*torch.no_grad"):
        kernels.selective_state_update(**_step_args(x=_t(2, 4).requires_grad_()), backend="triton")
    with torch.no_grad():  # fine without grad mode
        kernels.selective_state_update(**_step_args(x=_t(2, 4).requires_grad_()), backend="triton")
    if DEVICE == "cpu":
        meta = torch.empty(4, 3, device="meta")
        with pytest.raises(ValueError, match="one device"):
            kernels.selective_scan(**_scan_args(A=meta), backend="triton")
        with pytest.raises(ValueError, match="one device"):
            kernels.selective_state_update(**_step_args(A=meta), backend="triton")


# ----------------------------------------------------------------------------------------------
# Replayed launches (an eager decode loop repeats one call signature)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def recorded_plans(monkeypatch):
    """Plans for DEVICE's calls (CPU ones too), each replayed through a RecordingCompiled; yields the
    builds as (recording, args, kwargs) of the ordinary launch each was built from."""
    builds = record_step_plans(monkeypatch, ss)
    yield builds
    ss._STEP_PLANS.clear()


STEP_NAMES = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus")


def _step_key(**overrides):
    """ss._step_key of a (2, 4, 3)-state step's arguments (all options given) with ``overrides``."""
    args = _step_args(D=_t(4), z=_t(2, 4), dt_bias=_t(4), dt_softplus=True) | overrides
    return ss._step_key(*(args[name] for name in STEP_NAMES))


class _Subclass(torch.Tensor):
    pass


def test_step_plan_key_captures_the_specialization(monkeypatch):
    """The plan key of selective_state_update: equal for new tensors of the same signature,
    different when anything Triton specializes on or the checks read differs, None where no plan
    applies."""
    if DEVICE == "cpu":
        assert _step_key() is None  # plans are for CUDA calls only
    monkeypatch.setattr(ss._STEP_PLANS, "device_types", ("cuda", "cpu"))
    base = _step_key()
    assert base is not None and _step_key() == base  # new tensors at new addresses: one signature
    variants = [
        _step_key(state=_t(2, 3, 4).transpose(1, 2)),  # strides
        _step_key(x=_t(4, 2).t()),
        _step_key(B=_t(2, 6)[:, ::2]),
        _step_key(dt=_t(2 * 4 + 1)[1:].view(2, 4)),  # 4-byte alignment
        _step_key(C=_t(2 * 3 + 2)[2:].view(2, 3)),
        _step_key(x=_t(2, 4, dtype=F64)),  # dtype
        _step_key(state=_t(2, 4, 3, dtype=F64)),
        _step_key(B=_t(2, 3, dtype=torch.float16)),
        _step_key(state=_t(3, 4, 3), x=_t(3, 4), dt=_t(3, 4), B=_t(3, 3), C=_t(3, 3), z=_t(3, 4)),  # shape
        _step_key(B=_t(2, 1, 3), C=_t(2, 1, 3)),  # grouped B, C
        _step_key(D=None),  # absent options
        _step_key(z=None),
        _step_key(dt_bias=None),
        _step_key(dt_softplus=False),  # scalar arguments: value and type
        _step_key(dt_softplus=1),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    # No plan: grad mode with a tensor that requires grad (the step refuses it), a tensor subclass or
    # another layout, a flag that is not a plain value.
    assert _step_key(A=_t(4, 3).requires_grad_()) is None
    assert _step_key(state=_t(2, 4, 3).requires_grad_()) is None
    with torch.no_grad():
        assert _step_key(A=_t(4, 3).requires_grad_()) == base
    assert _step_key(D=_t(4).as_subclass(_Subclass)) is None
    assert _step_key(z=_t(2, 4).to_sparse()) is None
    assert _step_key(dt_softplus="False") is None and _step_key(x=[1.0]) is None


def _replay_problem(dtype, groups, *, apart=None):
    """step_inputs(3, 12, 4) with the state and x side by side (apart) in one buffer."""
    inputs = step_inputs(3, 12, 4, dtype, groups=groups)
    buffer = torch.randn(3 * 12 * 4 + 3 * 12, device=DEVICE)
    buffer[:144].view(3, 12, 4).copy_(inputs["state"])
    inputs["state"] = buffer[:144].view(3, 12, 4)
    if dtype == torch.float32:
        inputs["x"] = buffer[144:].view(3, 12).copy_(inputs["x"])
    return inputs


@pytest.mark.parametrize("dtype,groups", [(torch.float32, None), (torch.float16, 2)], ids=["fp32", "fp16-grouped"])
def test_step_replays_a_seen_signature(recorded_plans, monkeypatch, dtype, groups):
    """A signature's second call replays the first call's launch: the checks skipped, the new
    tensors (B and C cast to the fp32 compute dtype for fp16 inputs) handed to the launcher in the
    kernel's parameter order with the first call's scalars and constexprs, the same output and
    in-place state update (bits) as the ordinary path; a state that shares memory with an input,
    inputs that require grad and launch hooks take the ordinary path, with its errors."""
    from triton import knobs

    checks = []
    check = ss._check_selective_state_update_args
    monkeypatch.setattr(ss, "_check_selective_state_update_args", lambda *a: checks.append(1) or check(*a))

    def step(inputs):
        return kernels.selective_state_update(**inputs, dt_softplus=True, backend="triton")

    step(_replay_problem(dtype, groups))
    ((recording, args, kwargs),) = recorded_plans
    assert len(ss._STEP_PLANS) == 1 and len(checks) == 1 and not recording.calls
    second = _replay_problem(dtype, groups)
    copies = {name: t.clone() for name, t in second.items()}
    version = second["state"]._version
    got = step(second)
    assert len(checks) == 1, "the second call of a signature must replay the first call's plan"
    assert second["state"]._version > version, "the replay's write counts too"
    (call,) = recording.calls
    passed = dict(zip(("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "y"), call[9:19], strict=True))
    for name in ("state", "x", "dt", "A", "D", "z", "dt_bias"):
        assert passed[name] is second[name], name
    assert passed["y"] is got
    for name, built in (("B", args[4]), ("C", args[5])):  # in the compute dtype, with a group dim
        assert passed[name].dtype == torch.float32 and passed[name].stride() == built.stride()
        assert torch.equal(passed[name], ss._grouped(second[name], torch.float32, 3))
        assert (passed[name].data_ptr() == second[name].data_ptr()) == (dtype == torch.float32)
    names = ss.selective_state_update_kernel.arg_names
    assert call[19:] == args[10:] + tuple(kwargs[name] for name in names[len(args) :])
    with monkeypatch.context() as m:  # the ordinary path, on copies
        m.setattr(ss, "_step_key", lambda *a: None)
        assert torch.equal(got, step(copies)) and len(checks) == 2
    assert torch.equal(second["state"], copies["state"])  # updated in place alike

    if dtype == torch.float32:  # x inside the state's memory, with x's signature: the ordinary path's error
        inputs = _replay_problem(dtype, groups)
        inputs["x"] = inputs["state"].view(-1)[8:44].view(3, 12)
        assert ss._step_key(*(inputs.get(name, True) for name in STEP_NAMES)) in ss._STEP_PLANS
        calls = len(checks)
        error = _call("selective_state_update", "triton", **inputs, dt_softplus=True)
        assert error == _call("selective_state_update", "reference", **inputs, dt_softplus=True)
        assert error[0] is ValueError and "shares memory with state" in error[1] and len(checks) == calls + 1
    # Inputs that require grad in grad mode: the ordinary path's error.
    inputs = _replay_problem(dtype, groups)
    with pytest.raises(RuntimeError, match="not differentiable"):
        step(inputs | {"dt": inputs["dt"].clone().requires_grad_()})

    # While a launch hook is installed the ordinary launch runs (and calls it).
    seen, calls, replays = [], len(checks), len(recording.calls)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    step(_replay_problem(dtype, groups))
    assert len(checks) == calls + 1 and len(recording.calls) == replays
    assert bool(seen) == (DEVICE == "cuda")  # the interpreter calls no launch hook


# ----------------------------------------------------------------------------------------------
# GPU: the full sweep, bf16, realistic shapes, autotune configs, the mamba mixer (pytest -m gpu)
# ----------------------------------------------------------------------------------------------

GPU_LENGTHS = [1, 7, 8, 31, 32, 33, 64, 65, 300, 1000, 2049]
GPU_OPTIONS = [
    ((), False, False),
    (ALL, True, True),
    (("z",), False, True),
    (("D", "delta_bias"), True, False),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("d_state", [1, 4, 16, 64])
def test_gpu_sweep(dtype, d_state):
    # Every length x option set x grouping for this (dtype, N); one test id per compile key.
    for seqlen, (extras, init, softplus), groups in itertools.product(GPU_LENGTHS, GPU_OPTIONS, [None, 3]):
        inputs = make_inputs(2, 96, seqlen, d_state, dtype, groups=groups, extras=extras, init=init,
                             param_dtype=torch.float32 if dtype != torch.float32 else None,
                             softplus=softplus)  # fmt: skip
        try:
            assert_scan_accuracy(inputs, softplus=softplus)
        except AssertionError as exc:
            raise AssertionError(f"L={seqlen} extras={extras} init={init} G={groups}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(
    "batch,dim,seqlen,d_state,groups",
    [(2, 1536, 2048, 16, None), (1, 2048, 4096, 16, None), (4, 768, 1000, 16, 4), (2, 512, 777, 64, None)],
)
def test_gpu_realistic_shapes(dtype, batch, dim, seqlen, d_state, groups):
    # The mamba block's inputs: 16-bit activations, fp32 A / D / bias, softplus, z, an fp32 state.
    inputs = make_inputs(batch, dim, seqlen, d_state, dtype, groups=groups, extras=ALL, init=True,
                         param_dtype=torch.float32)  # fmt: skip
    assert_scan_accuracy(inputs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_backward_in_sequence_parts_batch1_long(monkeypatch, dtype):
    # A batch-1 Mamba layer at d_inner 1536, N = 16, over 32768 steps (the shape the backward's
    # sequence parts are for: 96 programs at one part), as the rule cuts it, against the reference.
    calls = backward_parts_spy(monkeypatch)
    inputs = make_inputs(1, 1536, 32768, 16, dtype, extras=ALL, init=True, param_dtype=torch.float32)
    assert_scan_accuracy(inputs)
    assert len(calls) == 1 and calls[0][0] > 1, calls


@pytest.mark.gpu
@gpu
def test_gpu_float64():
    for seqlen, groups in itertools.product([1, 33, 300], [None, 2]):
        assert_scan_accuracy(make_inputs(2, 64, seqlen, 16, F64, groups=groups, extras=ALL, init=True))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_every_autotune_config(dtype):
    # A config the autotuner may pick on another shape or run must be correct too.
    tuners = (
        ss.selective_scan_part_kernel,
        ss.selective_scan_fwd_kernel,
        ss.selective_scan_adjoint_part_kernel,
        ss.selective_scan_bwd_kernel,
    )
    for index in range(max(len(tuner.configs) for tuner in tuners)):
        with forced_config(tuners, index):
            # 2049: 4 sequence parts in the forward and in the backward.
            for seqlen, groups in [(1000, None), (777, 2), (2049, None)]:
                inputs = make_inputs(2, 256, seqlen, 16, dtype, groups=groups, extras=ALL, init=True,
                                     param_dtype=torch.float32)  # fmt: skip
                try:
                    assert_scan_accuracy(inputs)
                except AssertionError as exc:
                    raise AssertionError(f"config #{index}, L={seqlen}: {exc}") from exc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_prefill_and_decode(dtype):
    # Prefill 1000 tokens, then 40 decode steps (backend=None: the Triton kernels on CUDA): as
    # accurate against float64 as one scan over all 1040 tokens.
    inputs = make_inputs(4, 512, 1040, 16, dtype, extras=ALL, param_dtype=torch.float32)
    want = reference.selective_scan(**{k: v.double() for k, v in inputs.items()}, delta_softplus=True)
    full = kernels.selective_scan(**inputs, delta_softplus=True)
    prefix = {k: (v[..., :1000] if v.shape[-1] == 1040 else v) for k, v in inputs.items()}
    y_pre, state = kernels.selective_scan(**prefix, delta_softplus=True, return_last_state=True)
    steps = [
        kernels.selective_state_update(
            state, inputs["u"][..., t], inputs["delta"][..., t], inputs["A"], inputs["B"][..., t],
            inputs["C"][..., t], inputs["D"], inputs["z"][..., t], inputs["delta_bias"], True,
        )
        for t in range(1000, 1040)
    ]  # fmt: skip
    got = torch.cat([y_pre, torch.stack(steps, -1)], -1)
    err = (got.double() - want).abs().max().item()
    full_err = (full.double() - want).abs().max().item()
    assert err <= 2 * full_err + rounding_atol(want, dtype), (err, full_err)


@pytest.mark.gpu
@gpu
def test_gpu_decode_step_large_batch():
    # The decode shape: batch 1024, dim 4096, N = 16, fp32 state (268 MB).
    inputs = step_inputs(1024, 4096, 16, torch.bfloat16)
    inputs["A"], inputs["D"], inputs["dt_bias"] = (inputs[k].float() for k in ("A", "D", "dt_bias"))
    ref = {k: v.clone() for k, v in inputs.items()}
    y = kernels.selective_state_update(**inputs, dt_softplus=True)
    y_ref = kernels.selective_state_update(**ref, dt_softplus=True, backend="reference")
    torch.testing.assert_close(inputs["state"], ref["state"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 * 2.0**-8, atol=2 * 2.0**-8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("settings", [dict(), dict(d_state=8, d_conv=3, expand=1)], ids=["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_mamba_mixer_matches_reference_backend(monkeypatch, settings, dtype):
    # The mixer calls kernels.selective_scan / selective_state_update with backend=None: the Triton
    # kernels on CUDA. Same mixer and input, once more with the reference forced: the forward,
    # every parameter gradient, and prefill + token-by-token decode (with its cache) agree.
    from mixers import build_mixer

    mixer = build_mixer("mamba", 256, **settings).to(DEVICE, dtype)
    x = torch.randn(2, 300, 256, device=DEVICE, dtype=dtype)
    results = mixer_runs_with_reference_ops(
        monkeypatch,
        mixer,
        x,
        ("selective_scan", "selective_state_update"),
        ("ssm_state", "conv_state"),
        prefill=280,
    )
    (y_tr, g_tr, dec_tr, ssm_tr, conv_tr), (y_ref, g_ref, dec_ref, ssm_ref, conv_ref) = results
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y_tr, y_ref, **tol)
    torch.testing.assert_close(dec_tr, dec_ref, **tol)
    torch.testing.assert_close(dec_tr, y_tr, **tol)  # decode path == full forward
    torch.testing.assert_close(ssm_tr, ssm_ref, **tol)
    torch.testing.assert_close(conv_tr, conv_ref, **tol)
    for a, b in zip(g_tr, g_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "dtype,groups,options,layout",
    [
        (torch.bfloat16, None, ("D", "z", "dt_bias"), "mixer"),  # as the mamba mixer calls it: B, C cast to fp32
        (torch.float32, 4, ("D",), "contiguous"),
        (torch.float16, 2, ("z", "dt_bias"), "strided"),
    ],
)
def test_gpu_step_replayed_launches(dtype, groups, options, layout, monkeypatch):
    """A signature's second call replays its plan on new tensors: the same output and in-place state
    update (bits) as the checked (ordinary) call on copies, a new plan for another alignment,
    gradients refused, a launch hook honoured, and the replay captured in a CUDA graph reads the
    graph's inputs."""
    from triton import knobs

    from kernels._host import launch_hooks_installed

    batch, dim, d_state, dt_rank = 4, 256, 16, 8
    names = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")

    def fresh():  # same shapes and strides each time; new values
        inputs = step_inputs(batch, dim, d_state, dtype, groups=groups)
        inputs = {name: t for name, t in inputs.items() if name not in ("D", "z", "dt_bias") or name in options}
        if layout == "mixer":  # x and z halves of one projection, dt, B and C slices of another
            xz = torch.randn(batch, 2 * dim, device=DEVICE, dtype=dtype)
            inputs["x"], inputs["z"] = xz.chunk(2, dim=-1)
            proj = torch.randn(batch, dt_rank + 2 * d_state, device=DEVICE, dtype=dtype)
            _, inputs["B"], inputs["C"] = proj.split([dt_rank, d_state, d_state], dim=-1)
            inputs["A"], inputs["D"], inputs["dt_bias"] = (inputs[k].float() for k in ("A", "D", "dt_bias"))
        elif layout == "strided":  # the state every other channel of a larger cache, x transposed
            big = torch.randn(batch, 2 * dim, d_state, device=DEVICE)
            inputs["state"] = big[:, ::2]
            inputs["x"] = inputs["x"].t().contiguous().t()
        return inputs

    def step(inputs):
        return kernels.selective_state_update(**inputs, dt_softplus=True, backend="triton")

    def ordinary(inputs):  # the checked path on copies: (y, state)
        inputs = {name: same_layout(t) for name, t in inputs.items()}
        with monkeypatch.context() as m:
            m.setattr(ss, "_step_key", lambda *a: None)
            return step(inputs), inputs["state"]

    def assert_equal(got, want):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    # The ordinary path checks its arguments; a replay does not: count the checks.
    checks = []
    check = ss._check_selective_state_update_args
    monkeypatch.setattr(ss, "_check_selective_state_update_args", lambda *a: checks.append(1) or check(*a))
    ss._STEP_PLANS.clear()
    step(fresh())
    assert len(ss._STEP_PLANS) == 1 and len(checks) == 1
    second = fresh()
    want = ordinary(second)
    calls = len(checks)
    got = step(second)
    assert len(checks) == calls, "the second call of a signature must replay the first call's plan"
    assert_equal((got, second["state"]), want)

    # dt at an address that is not 16-byte aligned: Triton specializes on alignment, so another plan.
    dt = second["dt"]
    shifted = torch.empty(dt.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(dt.shape).copy_(dt)
    assert shifted.stride() == dt.stride() and shifted.data_ptr() % 16
    inputs = fresh() | {"dt": shifted}
    want = ordinary(inputs)
    assert_equal((step(inputs), inputs["state"]), want)
    assert len(ss._STEP_PLANS) == 2

    with pytest.raises(RuntimeError, match="not differentiable"):
        step(second | {"x": second["x"].clone().requires_grad_()})

    seen = []
    assert not launch_hooks_installed()
    inputs = fresh()
    want = ordinary(inputs)
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", seen.append)
        assert launch_hooks_installed()
        calls = len(checks)
        assert_equal((step(inputs), inputs["state"]), want)
    assert seen and len(checks) == calls + 1, "with a launch hook the ordinary launch (which calls it) must run"

    # As LanguageModel.generate does: one eager step stores the plan, the capture replays it.
    static = {name: same_layout(t) for name, t in fresh().items()}
    step(static)
    assert ss._step_key(*(static.get(name) for name in names), True) in ss._STEP_PLANS
    calls = len(checks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = step(static)
    assert len(checks) == calls, "the capture must replay the plan"
    new = fresh()
    want = ordinary(new)
    for name, t in static.items():
        t.copy_(new[name])
    graph.replay()
    assert_equal((graphed, static["state"]), want)
