"""Houlsby adapters (pipeline.modeling.adapters, METHOD.md section 3) as units, against the method's definition.

Each test states a property of the adapter that the method needs: round 0 is the backbone (W_up = 0, biases 0,
the layer's own LayerNorm taken over), W_down ~ N(0, init_std^2) drawn from the seed alone, a state that names
every parameter of every adapted layer and loads back exactly, and a shape or key mismatch named instead of
loaded. The equation itself and the model-level round-0 identity are in tests/test_model.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline.modeling.adapters import AdapterConfig, AdapterSet, HoulsbyAdapter, output_layer_norm
from tests.errors import names
from tests.tiny_models import tiny

PARAMS = ("down.weight", "down.bias", "up.weight", "up.bias", "norm.weight", "norm.bias")


def _layer_norm(hidden: int, seed: int, eps: float = 1e-12) -> nn.LayerNorm:
    """A LayerNorm with pretrained-like (not 1 / 0) gain and bias and a non-default eps (BERT's 1e-12)."""
    ln = nn.LayerNorm(hidden, eps=eps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ln.weight.copy_(0.5 + torch.rand(hidden, generator=g))
        ln.bias.copy_(torch.randn(hidden, generator=g) * 0.2)
    return ln


# ----------------------------------------------------------------------------------------------- config
def test_config_defaults_are_the_documented_ones():
    cfg = AdapterConfig(top_k=2, bottleneck=8)
    # biases on (our default), W_down std 0.02 (BERT/BART initializer_range), global RNG unless seeded
    assert (cfg.bias, cfg.init_std, cfg.seed) == (True, 0.02, None)


@pytest.mark.parametrize(
    "top_k, bottleneck, message",
    [
        (0, 8, ("top_k", "0")),
        (-1, 8, ("top_k", "-1")),
        (2, 0, ("bottleneck", "0")),
    ],
)
def test_config_rejects_no_layer_and_an_empty_bottleneck(top_k, bottleneck, message):
    with pytest.raises(ValueError) as err:
        AdapterConfig(top_k=top_k, bottleneck=bottleneck)
    names(err.value, *message)


def test_one_layer_with_a_one_unit_bottleneck_is_allowed():
    cfg = AdapterConfig(top_k=1, bottleneck=1)
    adapters = AdapterSet(4, cfg, [None])
    assert len(adapters) == 1 and adapters[0].down.weight.shape == (1, 4)


# ----------------------------------------------------------------------------------------------- initialisation
def test_round0_adapter_is_the_identity_before_the_layer_norm_it_takes_over():
    """W_up = 0 and zero biases: Y + ReLU(Y W_down) W_up = Y, so Y_hat = LN_layer(Y) exactly, with the layer's
    own gain, bias and eps (whatever W_down is)."""
    hidden = 6
    ln = _layer_norm(hidden, seed=1, eps=1e-12)
    adapter = HoulsbyAdapter(hidden, 3)
    adapter.reset_parameters(0.5, ln, torch.Generator().manual_seed(0))
    assert torch.count_nonzero(adapter.up.weight) == 0
    assert torch.count_nonzero(adapter.down.bias) == 0 and torch.count_nonzero(adapter.up.bias) == 0
    assert torch.count_nonzero(adapter.down.weight) == adapter.down.weight.numel()  # the bottleneck is not dead
    assert adapter.norm.eps == 1e-12
    assert torch.equal(adapter.norm.weight, ln.weight) and torch.equal(adapter.norm.bias, ln.bias)
    y = torch.randn(2, 5, hidden) * 3 + 1
    with torch.no_grad():
        assert torch.equal(adapter(y), ln(y))
    # taken over by value: the layer's LayerNorm stays frozen when the adapter's is trained
    with torch.no_grad():
        adapter.norm.weight.add_(1.0)
    assert not torch.equal(adapter.norm.weight, ln.weight)


def test_without_a_layer_norm_the_adapter_norm_is_a_unit_layer_norm():
    """Pre-LN layers (no output LayerNorm): gain 1, bias 0, eps 1e-5 (PyTorch's and BART's default), whatever the
    parameters held before."""
    hidden = 5
    adapter = HoulsbyAdapter(hidden, 2)
    with torch.no_grad():
        adapter.norm.weight.fill_(3.0)
        adapter.norm.bias.fill_(-2.0)
    adapter.reset_parameters(0.02, None)
    assert torch.equal(adapter.norm.weight, torch.ones(hidden)) and torch.equal(adapter.norm.bias, torch.zeros(hidden))
    assert adapter.norm.eps == 1e-5
    # a constant row has variance 0: the output is bias + 0 / sqrt(eps), i.e. exactly 0 for a unit norm
    y = torch.full((1, hidden), 7.0)
    with torch.no_grad():
        assert torch.equal(adapter(y), torch.zeros(1, hidden))
    # eps enters the normalisation: with rows of variance 1e-5 the output is x_hat / sqrt(2)
    row = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]]) * (1e-5 * 5 / 4) ** 0.5
    with torch.no_grad():
        out = adapter(row)
    torch.testing.assert_close(out, row / (2e-5) ** 0.5, rtol=1e-4, atol=0)


def test_the_eps_given_is_the_layer_norms_until_a_layer_norm_is_taken_over():
    adapter = HoulsbyAdapter(4, 2, eps=1e-3)
    assert adapter.norm.eps == 1e-3
    y = torch.tensor([[0.0, 0.0, 0.0, 0.1]])  # variance 1.875e-3, comparable to eps: the output depends on it
    with torch.no_grad():
        expected = torch.nn.functional.layer_norm(y, (4,), eps=1e-3)
        assert torch.equal(adapter.norm(y), expected)
    adapter.reset_parameters(0.02, _layer_norm(4, seed=0, eps=1e-7))
    assert adapter.norm.eps == 1e-7


def test_a_layer_norm_without_affine_parameters_counts_as_none():
    adapter = HoulsbyAdapter(4, 2)
    adapter.reset_parameters(0.02, nn.LayerNorm(4, elementwise_affine=False))
    assert torch.equal(adapter.norm.weight, torch.ones(4)) and torch.equal(adapter.norm.bias, torch.zeros(4))


def test_w_down_is_normal_with_the_configured_std():
    """N(0, init_std^2): over 64 x 512 draws the sample mean and std are within 5 standard errors."""
    std = 0.05
    adapter = HoulsbyAdapter(512, 64)
    adapter.reset_parameters(std, None, torch.Generator().manual_seed(3))
    w = adapter.down.weight.detach().double()
    n = w.numel()
    assert abs(float(w.mean())) < 5 * std / n**0.5
    assert abs(float(w.std()) - std) < 5 * std / (2 * n) ** 0.5
    # normal, not uniform: about 68.3 % of the draws lie within one std (uniform with this std: 57.7 %)
    assert abs(float((w.abs() < std).double().mean()) - 0.6827) < 0.01


def test_without_biases_there_are_no_bias_parameters():
    adapters = AdapterSet(4, AdapterConfig(top_k=2, bottleneck=3, bias=False), [None, None])
    assert sorted(adapters.state()) == sorted(
        f"layer{i}.{p}" for i in range(2) for p in ("down.weight", "up.weight", "norm.weight", "norm.bias")
    )
    assert adapters[0].down.bias is None and adapters[0].up.bias is None


def test_a_seeded_set_is_a_function_of_the_seed_only():
    def draw(seed, noise):
        torch.manual_seed(noise)  # whatever the global RNG holds
        return AdapterSet(8, AdapterConfig(top_k=2, bottleneck=4, seed=seed), [None, None]).state()

    a, b, c = draw(5, 0), draw(5, 1), draw(6, 0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layer0.down.weight"], c["layer0.down.weight"])
    # one generator for the whole set: the layers get different draws
    assert not torch.equal(a["layer0.down.weight"], a["layer1.down.weight"])
    # the seed's draws are those of a generator seeded with it, layer after layer
    g = torch.Generator().manual_seed(5)
    first = torch.empty(4, 8).normal_(0.0, 0.02, generator=g)
    second = torch.empty(4, 8).normal_(0.0, 0.02, generator=g)
    assert torch.equal(a["layer0.down.weight"], first) and torch.equal(a["layer1.down.weight"], second)


def test_unseeded_set_follows_the_global_rng():
    torch.manual_seed(11)
    a = AdapterSet(8, AdapterConfig(top_k=1, bottleneck=4), [None]).state()
    torch.manual_seed(11)
    b = AdapterSet(8, AdapterConfig(top_k=1, bottleneck=4), [None]).state()
    torch.manual_seed(12)
    c = AdapterSet(8, AdapterConfig(top_k=1, bottleneck=4), [None]).state()
    assert torch.equal(a["layer0.down.weight"], b["layer0.down.weight"])
    assert not torch.equal(a["layer0.down.weight"], c["layer0.down.weight"])


def test_each_adapter_takes_over_its_own_layers_norm():
    norms = [_layer_norm(6, seed=1), None, _layer_norm(6, seed=2, eps=1e-6)]
    adapters = AdapterSet(6, AdapterConfig(top_k=3, bottleneck=2, seed=0), norms)
    assert torch.equal(adapters[0].norm.weight, norms[0].weight) and adapters[0].norm.eps == 1e-12
    assert torch.equal(adapters[1].norm.weight, torch.ones(6)) and adapters[1].norm.eps == 1e-5
    assert torch.equal(adapters[2].norm.bias, norms[2].bias) and adapters[2].norm.eps == 1e-6


# ----------------------------------------------------------------------------------------------- output LayerNorm
def test_output_layer_norm_of_post_ln_decoders_and_none_otherwise():
    bart, _ = tiny("bart")
    layer = bart.model.decoder.layers[-1]
    assert output_layer_norm(layer) is layer.final_layer_norm
    bert, _ = tiny("bert2bert")
    blayer = bert.decoder.bert.encoder.layer[-1]
    assert output_layer_norm(blayer) is blayer.output.LayerNorm
    assert output_layer_norm(nn.Linear(2, 2)) is None  # no LayerNorm at all

    class NotALayerNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.final_layer_norm = nn.Identity()  # named like one, but not a LayerNorm
            self.output = nn.Module()
            self.output.LayerNorm = nn.LayerNorm(3)

    odd = NotALayerNorm()
    assert output_layer_norm(odd) is odd.output.LayerNorm  # the first name is skipped, the second found

    class OutputWithoutNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.output = nn.Linear(2, 2)

    assert output_layer_norm(OutputWithoutNorm()) is None


# ----------------------------------------------------------------------------------------------- state
def test_state_names_every_parameter_of_every_layer_as_detached_float32_copies():
    adapters = AdapterSet(6, AdapterConfig(top_k=2, bottleneck=3, seed=1), [None, None])
    state = adapters.state()
    assert sorted(state) == sorted(f"layer{i}.{p}" for i in range(2) for p in PARAMS)
    for i in range(2):
        for p in PARAMS:
            module, attr = p.split(".")
            param = getattr(getattr(adapters[i], module), attr)
            value = state[f"layer{i}.{p}"]
            assert torch.equal(value, param.detach()) and value.dtype == torch.float32
            assert not value.requires_grad and value.data_ptr() != param.data_ptr()
    with torch.no_grad():
        adapters[0].down.weight.add_(1.0)  # the state is a snapshot
    assert not torch.equal(state["layer0.down.weight"], adapters[0].down.weight)


def test_state_of_a_half_precision_set_is_float32():
    adapters = AdapterSet(4, AdapterConfig(top_k=1, bottleneck=2, seed=1), [None]).to(torch.bfloat16)
    assert all(v.dtype == torch.float32 for v in adapters.state().values())


@settings(max_examples=20, deadline=None)
@given(top_k=st.integers(1, 3), bottleneck=st.integers(1, 5), seed=st.integers(0, 1000))
def test_load_state_round_trips_exactly(top_k, bottleneck, seed):
    """load_state(state()) of another set makes it the same set, parameter by parameter, in the target dtype."""
    source = AdapterSet(6, AdapterConfig(top_k=top_k, bottleneck=bottleneck, seed=seed), [None] * top_k)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    target = AdapterSet(6, AdapterConfig(top_k=top_k, bottleneck=bottleneck, seed=seed + 1), [None] * top_k)
    target.load_state(source.state())
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name
    half = AdapterSet(6, AdapterConfig(top_k=top_k, bottleneck=bottleneck), [None] * top_k).to(torch.float64)
    half.load_state(source.state())
    assert all(p.dtype == torch.float64 for p in half.parameters())
    assert torch.equal(half[0].down.weight, source[0].down.weight.double())


def test_load_state_names_missing_unknown_and_misshapen_tensors():
    adapters = AdapterSet(4, AdapterConfig(top_k=1, bottleneck=2, seed=1), [None])
    state = adapters.state()
    missing = {k: v for k, v in state.items() if k != "layer0.up.bias"}
    with pytest.raises(ValueError) as err:
        adapters.load_state(missing)
    assert "layer0.up.bias" in names(err.value) and "layer1" not in str(err.value)
    with pytest.raises(ValueError) as err:
        adapters.load_state({**state, "layer1.up.bias": torch.zeros(4)})
    assert "layer1.up.bias" in names(err.value) and "layer0" not in str(err.value)
    many = {f"layer{i}.x": torch.zeros(1) for i in range(6)}
    with pytest.raises(ValueError) as err:
        adapters.load_state(many)
    # at most four names of each kind, sorted: one short line however many keys are wrong
    names(
        err.value,
        "'layer0.down.bias', 'layer0.down.weight', 'layer0.norm.bias', 'layer0.norm.weight']",
        "'layer0.x', 'layer1.x', 'layer2.x', 'layer3.x']",
    )
    assert "layer4.x" not in str(err.value)
    bad = {**state, "layer0.up.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError) as err:
        adapters.load_state(bad)
    names(err.value, "layer0.up.weight", "(2, 4)", "(4, 2)")


def test_adapter_files_get_the_mode_of_any_other_output(tmp_path):
    # safetensors' save_file creates 0600 whatever the umask; other sites and the DVC cache must read adapters too
    from pipeline.common import atomic
    from pipeline.modeling.adapters import load_adapter, save_adapter

    save_adapter(tmp_path / "a.safetensors", {"w": torch.ones(2, 3)}, {"client": "A"})
    atomic.write_text(tmp_path / "b.json", "{}")
    assert (tmp_path / "a.safetensors").stat().st_mode == (tmp_path / "b.json").stat().st_mode
    assert torch.equal(load_adapter(tmp_path / "a.safetensors")["w"], torch.ones(2, 3))


def test_equal_adapters_are_equal_files(tmp_path):
    # safetensors orders metadata as a hash map does (a new order per map); DVC hashes bytes, so a rerun with equal
    # weights must write the same bytes, and the file must still load as safetensors with its metadata
    from safetensors import safe_open

    from pipeline.modeling.adapters import save_adapter

    meta = {f"key{i}": str(i) for i in range(8)}
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(5, dtype=torch.float16)}
    for i in range(6):
        save_adapter(tmp_path / f"{i}.safetensors", tensors, dict(reversed(meta.items())) if i % 2 else meta)
    assert len({p.read_bytes() for p in tmp_path.iterdir()}) == 1
    with safe_open(tmp_path / "5.safetensors", "pt") as f:
        assert f.metadata() == meta and torch.equal(f.get_tensor("b"), tensors["b"])
        assert torch.equal(f.get_tensor("a"), tensors["a"])


@pytest.mark.parametrize("damage", [lambda b: b[:-4], lambda b: b[:6], lambda b: b"\xff" * 8 + b[8:]])
def test_a_damaged_adapter_file_is_one_data_error_naming_it(tmp_path, damage):
    # a resumed client's round checkpoint, an adapter the evaluation reads: cut short or with a broken header it was
    # safetensors' SafetensorError ('incomplete metadata, file not fully covered'), naming no file
    from pipeline.common.schema import DataError
    from pipeline.modeling.adapters import load_adapter, save_adapter

    path = tmp_path / "adapter_best.safetensors"
    save_adapter(path, {"w": torch.ones(2, 3)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as err:
        load_adapter(path)
    names(err.value, str(path), "not a readable adapter file")
