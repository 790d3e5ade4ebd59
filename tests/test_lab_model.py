"""The labs' model (parlab/core/lab_model.py): each piece against PyTorch's own, and its training reproducible."""

import pytest
import torch
import torch.nn.functional as F

from parlab.core.lab_model import (
    LabConfig,
    apply_rope,
    build_lab_model,
    gqa_attention,
    lab_batches,
    lab_loss,
    rms_norm,
    train_lab_single_device,
)

f64 = torch.float64


def test_grouped_query_attention_equals_torch_sdpa_with_enable_gqa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, generator=gen, dtype=f64)
    k, v = torch.randn(2, 2, 5, 4, generator=gen, dtype=f64), torch.randn(2, 2, 5, 4, generator=gen, dtype=f64)
    for causal in (True, False):
        ours = gqa_attention(q, k, v, causal=causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert (ours - theirs).abs().max() < 1e-14


def test_rms_norm_equals_torch_rmsnorm():
    x = torch.randn(3, 7, 32, dtype=f64)
    norm = torch.nn.RMSNorm(32, eps=1e-6, dtype=f64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, dtype=f64))
    assert (rms_norm(x, norm.weight, 1e-6) - norm(x)).abs().max() < 1e-14


def test_rope_is_a_rotation_whose_scores_depend_only_on_the_distance():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, generator=gen, dtype=f64), torch.randn(1, 1, 1, 8, generator=gen, dtype=f64)

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, torch.tensor([m])) * apply_rope(k, torch.tensor([n]))).sum()

    assert abs(score(3, 1) - score(10, 8)) < 1e-13 and abs(score(3, 1) - score(4, 1)) > 1e-6
    assert torch.allclose(apply_rope(q, torch.tensor([5])).norm(), q.norm())  # a rotation keeps the length
    # Pair i is dimensions i and i + hd/2, turned by position * base^(-2i/hd): the complex-number form.
    half = q[..., :4] + 1j * q[..., 4:]
    turned = half * torch.exp(1j * 5 * 10000.0 ** (-torch.arange(0, 8, 2, dtype=f64) / 8))
    assert torch.allclose(apply_rope(q, torch.tensor([5])), torch.cat([turned.real, turned.imag], -1))


def test_the_lab_model_is_not_the_lessons_gpt():
    model = build_lab_model(LabConfig())
    names = dict(model.named_parameters())
    assert not [n for n in names if n.endswith("bias")]
    assert names["blocks.0.attn.k.weight"].shape == (16, 32) and names["blocks.0.attn.q.weight"].shape == (32, 32)
    assert {"blocks.0.mlp.gate.weight", "blocks.0.mlp.up.weight", "blocks.0.mlp.down.weight"} <= set(names)
    tied = build_lab_model(LabConfig(tied=True))
    assert "head.weight" not in dict(tied.named_parameters())


def test_positions_enter_only_through_rope():
    """The model's logits of tokens t0.. given their positions equal the whole sequence's rows t0..: what a rank
    that holds a slice of the sequence must reproduce (no position table)."""
    cfg = LabConfig(layers=1)
    model = build_lab_model(cfg)
    x, _ = lab_batches(cfg, 2, 1)[0]
    whole = model(x)
    assert not torch.allclose(model(x[:, 8:]), whole[:, 8:])  # a slice at positions 0.. is another computation
    # Only the first layer's attention sees other tokens; a slice keeps its own causal past when it starts at 0.
    assert torch.allclose(model(x[:, :8], torch.arange(8)), whole[:, :8], atol=1e-14)


def test_single_device_training_is_deterministic_and_learns():
    cfg = LabConfig()
    batches = lab_batches(cfg, 8, 6)
    first = train_lab_single_device(cfg, batches, seed=3, optimizer="adam", lr=1e-2)
    again = train_lab_single_device(cfg, batches, seed=3, optimizer="adam", lr=1e-2)
    assert first.losses == again.losses and first.losses[-1] < first.losses[0]
    model = build_lab_model(cfg, seed=3)
    x, y = batches[0]
    assert abs(lab_loss(model(x), y).item() - first.losses[0]) < 1e-15


@pytest.mark.parametrize(
    "kwargs, words",
    [({"hidden": 30}, "divisible by heads"), ({"kv_heads": 3}, "divisible by kv_heads"), ({"hidden": 12}, "even")],
)
def test_config_refuses_shapes_it_cannot_build(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LabConfig(**kwargs)
