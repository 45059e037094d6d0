"""Sampling: greedy is deterministic; seeded sampling repeats; stop at EOS or max tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from server.engine.sampling import Sampler, _nucleus
from server.engine.types import SamplingParams
from tests.engine.conftest import make_runner, msg, run, tenant


def test_seeded_sampling_repeats_and_differs_by_seed(family: str) -> None:
    t = tenant()
    messages = [msg("user", "Tell me a story about a red square.")]
    hot = dict(max_tokens=12, temperature=1.5, top_p=0.95)
    a = run(make_runner(family), t, messages, sampling=SamplingParams(seed=7, **hot))
    b = run(make_runner(family), t, messages, sampling=SamplingParams(seed=7, **hot))
    c = run(make_runner(family), t, messages, sampling=SamplingParams(seed=8, **hot))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_max_tokens_finish_reason(family: str) -> None:
    r = run(make_runner(family), tenant(), [msg("user", "Count to ten.")], max_tokens=3)
    assert r.usage.completion_tokens <= 3
    if r.finish == "length":
        assert len(r.tokens) == 3


def test_nucleus_keeps_smallest_set_reaching_top_p() -> None:
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    kept = _nucleus(logits, 0.7)
    assert mx.isinf(kept).tolist() == [False, False, True, True]
    kept = _nucleus(logits, 0.1)
    assert mx.isinf(kept).tolist() == [False, True, True, True]


def test_greedy_is_argmax() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler(mx.array([0.1, 3.0, 2.0])).item() == 1


@pytest.mark.parametrize("params", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params_raise(params: dict) -> None:
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**params))
