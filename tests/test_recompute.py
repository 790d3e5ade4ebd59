"""Activation recomputation: the saved activations of each mode against the adapted Korthikanti formula (within
5%; here exactly), numerics unchanged bit for bit, the recomputed FLOPs against the theory, bad input, a run."""

from __future__ import annotations

import pytest
import torch

from parlab.core.models import RECOMPUTE, GPTConfig
from parlab.runs.registry import launch_scheme, run_scheme
from parlab.schemes.recompute.measure import forward_flops_theory, measure_layer, measure_model, recompute_flops_theory
from parlab.schemes.recompute.theory import activation_terms, formula_bytes, korthikanti_bytes

CONFIGS = [
    (GPTConfig(), 2),  # the tests' model: T = 16, H = 32, nh = 4, F = 4H, float64
    (GPTConfig(seq_len=32, hidden=24, heads=3, ffn=40, dtype="float32"), 3),  # F != 4H, float32
]


@pytest.mark.parametrize("mode", RECOMPUTE)
@pytest.mark.parametrize("cfg, batch", CONFIGS)
def test_saved_activations_per_layer_equal_the_formula(cfg, batch, mode):
    measured, formula = measure_layer(cfg, batch, mode), formula_bytes(cfg, batch, mode)
    assert abs(measured - formula) <= 0.05 * formula, (measured, activation_terms(cfg, batch, mode))
    assert measured == formula  # term by term, nothing left out


def test_korthikanti_published_form_and_the_adaptation():
    cfg, b = GPTConfig(seq_len=64), 2
    s, h, a = 64, 32, 4
    assert korthikanti_bytes(cfg, b, "none") == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_bytes(cfg, b, "selective") == 34 * s * b * h
    assert korthikanti_bytes(cfg, b, "full") == 2 * s * b * h
    assert korthikanti_bytes(cfg, b, "none", "tp+sp", 4) == s * b * h / 4 * (34 + 5 * a * s / h)
    # in fp16 with dropout the reference GPT's terms would be Korthikanti's minus the dropout masks and output
    fp16 = {k: v // 4 for k, v in activation_terms(cfg, b, "none").items()}  # float64 -> 2 bytes a number
    dropout = 2 * s * b * h + 3 * a * s * s * b
    neglected = fp16["LayerNorm mean, 1/std (2 x 2)"] + cfg.seq_len**2 / 4
    assert sum(fp16.values()) - neglected == korthikanti_bytes(cfg, b, "none") - dropout
    tp, sp = activation_terms(cfg, b, "none", "tp", 4), activation_terms(cfg, b, "none", "tp+sp", 4)
    assert sum(tp.values()) < formula_bytes(cfg, b, "none")
    assert sp["LayerNorm inputs (2)"] * 4 == tp["LayerNorm inputs (2)"]  # SP splits the LayerNorm regions too
    assert sp["QKV input (LN1 output)"] == 3 * tp["QKV input (LN1 output)"]  # parlab's SP keeps 3 copies of it


@pytest.fixture(scope="module")
def runs():
    cfg, b = CONFIGS[0]
    return cfg, b, {mode: measure_model(cfg, b, mode) for mode in RECOMPUTE}


def test_numerics_unchanged_bit_for_bit(runs):
    _, _, out = runs
    for mode in RECOMPUTE[1:]:
        assert torch.equal(out[mode]["loss"], out["none"]["loss"])
        for name, g in out["none"]["grads"].items():
            assert torch.equal(out[mode]["grads"][name], g), (mode, name)


def test_recomputed_flops_and_memory_order(runs):
    cfg, b, out = runs
    for mode in RECOMPUTE:
        extra = out[mode]["backward_flops"] - out["none"]["backward_flops"]
        assert extra == cfg.layers * recompute_flops_theory(cfg, b, mode), mode
        assert out[mode]["forward_flops"] == out["none"]["forward_flops"]
    lm_head = 2 * b * cfg.seq_len * cfg.hidden * cfg.vocab_size
    assert out["none"]["forward_flops"] == cfg.layers * forward_flops_theory(cfg, b) + lm_head
    assert out["none"]["saved"] > out["selective"]["saved"] > out["full"]["saved"]


def test_unknown_mode_is_refused_before_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("parlab.runs.registry.launch", no_launch)
    with pytest.raises(ValueError, match="recompute must be one of"):
        GPTConfig(recompute="some")
    for scheme in ("tp", "pp", "megatron-sp"):
        with pytest.raises(ValueError, match="recompute must be one of"):
            run_scheme(scheme, world_size=2, recompute="some")
    for scheme in ("ring", "usp"):  # their GPT runs the blocks' layers itself: a mode would be ignored, so refused
        with pytest.raises(ValueError, match="recompute='full' is not applied by"):
            run_scheme(scheme, world_size=4, recompute="full")


def test_pipeline_with_full_recompute_matches_one_device():
    _, report = launch_scheme("pp", world_size=2, steps=1, microbatches=2, recompute="full")
    assert report["passed"], "\n".join(report["verdicts"])


def test_tensor_and_sequence_parallel_forms_measured_on_live_ranks():
    from parlab.lessons.tensor_parallel_memory import measure_parallel_forms

    forms = measure_parallel_forms(GPTConfig(seq_len=32), batch=2, world_size=2)
    for form, m in forms.items():
        assert m["measured"] == m["formula"], (form, m)
    assert forms["tp"]["measured"] < formula_bytes(GPTConfig(seq_len=32), 2, "none")  # each rank keeps less
