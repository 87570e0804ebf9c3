"""The static-shape decode step (models.model.DecodeStep) and generate()'s CUDA-graph loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import compose_train

import train as train_module
from models import LanguageModel
from models.model import DecodeStep

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_model(mixer: str, device: str = "cpu", dtype=torch.float64) -> LanguageModel:
    cfg = compose_train([f"mixer={mixer}", "model.d_model=32", "model.n_layers=8"])
    return LanguageModel(train_module.build_model_config(cfg, 37)).to(device, dtype).eval()


def test_decode_step_keeps_the_caches_host_counters():
    # Uncaptured (CPU): the step is the model on one token; caches advance by one per call.
    torch.manual_seed(0)
    model = tiny_model("attention")
    ids = torch.randint(0, 37, (2, 9))
    cache = model.allocate_cache(2, 9)
    with torch.no_grad():
        model(ids[:, :5], cache=cache)
        step = DecodeStep(model, cache, graphed=False)
        logits = [step(ids[:, t]) for t in range(5, 9)]
        full = model(ids)
    assert cache.seqlen == 9 and all(int(c.seqlens.max()) == 9 for c in cache.layers)
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 5:9], rtol=1e-10, atol=1e-12)


def test_a_graphed_step_of_cpu_tokens_is_refused():
    """A new user's finding: DecodeStep(graphed=True) on CPU failed at its second call with torch's
    "Tried to instantiate dummy base class CUDAGraph"; now the first call says what is wrong."""
    model = tiny_model("attention")
    cache = model.allocate_cache(2, 8)
    step = DecodeStep(model, cache, graphed=True)
    message = "needs CUDA tensors; got a token on cpu: pass graphed=False"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        step(torch.tensor([1, 2]))
    assert cache.seqlen == 0, "a refused step must not advance the cache"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "mixer", ["attention", "sliding_window", "hybrid_jamba", "linear_attention", "mamba"]
)
def test_gpu_graphed_generate_equals_eager(mixer):
    # Greedy tokens from the replayed graph equal the eager loop's, for more steps than the
    # sliding window (32) so the ring wraps under replay; attention-type mixers must capture.
    torch.manual_seed(0)
    model = tiny_model(mixer, "cuda", torch.float32)
    prompt = torch.randint(0, 37, (3, 7), device="cuda")
    eager = model.generate(prompt, 40, greedy=True, cuda_graph=False)
    with warnings.catch_warnings():
        if mixer in ("attention", "sliding_window"):
            warnings.simplefilter("error")  # a capture fallback would warn
        graphed = model.generate(prompt, 40, greedy=True, cuda_graph=True)
    assert torch.equal(graphed, eager)
