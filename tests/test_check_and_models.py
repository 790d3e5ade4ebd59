"""The verdict helper and the reference GPT."""

import math

import pytest
import torch

from parlab import check_equal, compare
from parlab.core.check import CheckFailed
from parlab.core.models import GPTConfig, build_model, make_batches, synthetic_corpus, train_single_device


def test_verdict_passes_within_the_dtype_tolerance_and_says_so():
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    verdict = compare("x", ref + 1e-13, ref)
    assert verdict.passed
    assert verdict.line == "x: matches single device: max |err| 1.0e-13 <= tol 1e-10 (float64): PASS"


def test_verdict_fails_and_raises_when_asked(capsys):
    ref = torch.zeros(3, dtype=torch.float32)
    verdict = compare("y", ref + 1e-3, ref, show=True)
    assert not verdict.passed
    assert capsys.readouterr().out.strip().endswith("> tol 1e-05 (float32): FAIL")
    with pytest.raises(CheckFailed):
        compare("y", ref + 1e-3, ref, raise_on_fail=True)


def test_shape_mismatch_missing_keys_and_nan_fail_instead_of_crashing():
    ref = {"a": torch.zeros(4), "b": torch.zeros(2)}
    assert "shape [3] vs [4]" in compare("s", {"a": torch.zeros(3), "b": torch.zeros(2)}, ref).line
    assert "keys differ" in compare("k", {"a": torch.zeros(4)}, ref).line
    nan = compare("n", {"a": torch.full((4,), math.nan), "b": torch.zeros(2)}, ref)
    assert not nan.passed and "FAIL" in nan.line


def test_nested_structures_take_the_worst_error():
    ref = [torch.zeros(2, dtype=torch.float64), {"w": torch.zeros(3, dtype=torch.float64)}]
    ours = [torch.zeros(2, dtype=torch.float64), {"w": torch.tensor([0.0, 5e-11, 2e-11], dtype=torch.float64)}]
    assert compare("nested", ours, ref).max_abs_err == pytest.approx(5e-11)


def test_count_check_is_exact():
    assert check_equal("bytes", 96, 96).line == "bytes: measured 96 = theory 96: PASS"
    assert not check_equal("bytes", 97, 96).passed


def test_model_is_deterministic_from_its_seed_and_ignores_the_global_rng():
    cfg = GPTConfig()
    torch.manual_seed(123)
    a = build_model(cfg, seed=7)
    torch.manual_seed(456)
    b = build_model(cfg, seed=7)
    c = build_model(cfg, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert pa.dtype == torch.float64
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)


def test_model_shapes_and_tied_head():
    cfg = GPTConfig(tied=True, dtype="float32")
    model = build_model(cfg)
    x, y = make_batches(cfg, batch_size=3, steps=1)[0]
    assert x.shape == y.shape == (3, cfg.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    logits = model(x)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size) and logits.dtype == torch.float32
    assert model.lm_head.weight is model.wte.weight


def test_attention_is_causal():
    cfg = GPTConfig()
    model = build_model(cfg)
    x = make_batches(cfg, 1, 1)[0][0]
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % cfg.vocab_size  # change only the last token
    before, after = model(x), model(changed)
    assert torch.equal(before[0, :-1], after[0, :-1])  # earlier positions cannot see it
    assert not torch.equal(before[0, -1], after[0, -1])


def test_single_device_training_learns_the_synthetic_corpus():
    cfg = GPTConfig()
    result = train_single_device(cfg, make_batches(cfg, 8, 30), lr=0.5)
    assert result.losses[0] == pytest.approx(math.log(cfg.vocab_size), abs=0.1)  # ~uniform at init
    assert result.losses[-1] < result.losses[0] - 0.4
    assert set(result.grads) == set(result.params) == {n for n, _ in build_model(cfg).named_parameters()}


def test_corpus_and_batches_are_deterministic():
    assert torch.equal(synthetic_corpus(64, 512, 3), synthetic_corpus(64, 512, 3))
    cfg = GPTConfig()
    a, b = make_batches(cfg, 4, 2, seed=1), make_batches(cfg, 4, 2, seed=1)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="hidden=30 is not divisible by heads=4"):
        GPTConfig(hidden=30)
    with pytest.raises(ValueError, match="dtype must be one of"):
        GPTConfig(dtype="int8")
