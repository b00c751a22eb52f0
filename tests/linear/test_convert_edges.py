"""``mxtrain.convert`` on models as users bring them, where a conversion could go silently wrong: PyTorch's
encoder layers (an inference fast path that reads the weights directly), copies and pickles of converted
models and parametrized weights (whose per-step random signs must still advance with the optimizer), layers
converted in several calls (repeated layer ids), tied output heads with other names, ``nn.Sequential``
models under a recipe that keeps its first and last blocks, lazy layers, and non-float inputs."""

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import mxtrain
from mxtrain.linear.module import MXLayer, mx_layers


def _encoder(layers: int | None = None):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, dim_feedforward=128, dropout=0.0, batch_first=True)
    return layer if layers is None else nn.TransformerEncoder(layer, layers, enable_nested_tensor=True)


@pytest.mark.parametrize("layers", [None, 2])
def test_encoder_layers_in_eval_run_their_mx_layers(layers):
    """In ``eval()`` under ``no_grad`` torch's encoder layer takes a fast path that multiplies by
    ``linear1.weight`` / ``linear2.weight`` itself: converted, it must compute what training mode computes (the
    MX layers), not the unconverted model's output."""
    plain = _encoder(layers)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        rep = mxtrain.convert(model, "mxfp4-all")
    assert any("fast path turned off" in t for t in rep.notes) and "fast path" in str(rep)
    x = torch.randn(3, 8, 64)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 5:] = True   # a padding mask: TransformerEncoder's nested-tensor path
    kw = {} if layers is None else {"src_key_padding_mask": mask}
    with torch.no_grad():
        model.train()
        y_train = model(x, **kw)
        model.eval()
        y_eval = model(x, **kw)
        plain.eval()
        y_plain = plain(x, **kw)
    keep = ~mask[..., None] if layers else torch.ones_like(y_eval, dtype=torch.bool)
    y_eval = torch.nan_to_num(y_eval) * keep   # (the nested path pads masked rows with zeros)
    assert torch.allclose(y_eval, y_train * keep, atol=1e-5), (y_eval - y_train * keep).abs().max()
    assert (y_eval - y_plain * keep).abs().max() > 1e-3   # quantized, not the high-precision model


def _seq(recipe="mxfp4-all-rht16"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    mxtrain.convert(m, recipe)
    return m


def _steps(m, params=None, n=2):
    """``n`` optimizer steps at lr 0 on one batch: the outputs and each MX layer's step afterwards."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(list(m.parameters()) if params is None else params, lr=0.0)
    ys = []
    for _ in range(n):
        y = m(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        ys.append(y.detach())
    return ys, [layer.step for _, layer in mx_layers(m)]


def _pickled(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("make", ["deepcopy", "torch.save/load", "weight_norm"])
def test_per_step_signs_advance_for_copies_pickles_and_parametrized_weights(make):
    """A per-step random rotation (``mxfp4-all-rht16``) draws new signs at every optimizer step, also for a deep
    copy of a converted model (an EMA copy), a model saved and loaded whole, and a parametrized weight
    (``weight_norm``: the optimizer holds ``original0/1``, not ``weight``)."""
    if make == "weight_norm":
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        torch.nn.utils.parametrizations.weight_norm(m[0])
        torch.nn.utils.parametrizations.weight_norm(m[2])
        rep = mxtrain.convert(m, "mxfp4-all-rht16")
        assert rep.mx_params == sum(p.numel() for p in m.parameters())   # the originals counted
    else:
        m = (copy.deepcopy if make == "deepcopy" else _pickled)(_seq())
    ys, steps = _steps(m)
    assert steps == [2, 2]
    assert not torch.equal(ys[0], ys[1])   # lr 0, the same batch: only the signs changed


def test_a_frozen_layer_advances_with_its_trained_bias_and_not_without():
    """An optimizer that trains any parameter of a layer (here only its bias) advances its step; a layer that
    no optimizer trains keeps its step (``mxtrain.set_step`` numbers it)."""
    m = _seq()
    m[0].weight.requires_grad_(False)
    m[2].weight.requires_grad_(False)
    _, steps = _steps(m, params=[m[0].bias])
    assert steps == [2, 0]


def test_layers_sharing_an_id_warn_at_the_first_step_and_first_layer_id_numbers_them_apart():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)))
    for b in blocks:
        mxtrain.convert(b, "mxfp4-all-sr")   # one call per block: ids 0, 0, 0
    with pytest.warns(UserWarning, match=r"share layer ids \(3 have layer_id 0.*first_layer_id"):
        _steps(blocks, n=1)
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)))
    for i, b in enumerate(blocks):
        mxtrain.convert(b, "mxfp4-all-sr", first_layer_id=i)
    assert [layer.layer_id for _, layer in mx_layers(blocks)] == [0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(blocks, n=2)
    # a recipe with no random inputs cannot draw alike: no warning
    torch.manual_seed(0)
    plain = nn.Sequential(mxtrain.MXLinear(64, 64, recipe="mxfp4-all"), mxtrain.MXLinear(64, 64, recipe="mxfp4-all"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(plain, n=1)
    with pytest.raises(ValueError, match="first_layer_id"):
        mxtrain.convert(nn.Linear(64, 64), "mxfp4-all", first_layer_id=-1)


class _MLM(nn.Module):
    """A masked-LM shape: the output decoder ties its weight to the word embedding under a name no skip
    pattern knows (as BERT's ``cls.predictions.decoder``)."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(96, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.transform = nn.Linear(64, 64)
        self.decoder = nn.Linear(64, 96)
        self.decoder.weight = self.words.weight


def test_a_tied_head_stays_in_high_precision_whatever_its_name_and_a_string_skip_is_one_pattern():
    rep = mxtrain.convert(_MLM(), "mxfp4-all")
    assert not isinstance(rep.model.decoder, MXLayer)
    assert "weight of embedding 'words'" in rep.kept["decoder"]
    assert rep.converted == ["layers.0", "layers.1", "transform"]
    assert "converted outside numbered blocks" in str(rep) and "transform (64 -> 64)" in str(rep)
    rep = mxtrain.convert(_MLM(), "mxfp4-all", keep_tied=False)
    assert isinstance(rep.model.decoder, MXLayer)
    rep = mxtrain.convert(_MLM(), "mxfp4-all", skip="transform", keep_tied=False)   # a string: one pattern
    assert rep.kept == {"transform": "matches skip pattern 'transform'"} and isinstance(rep.model.decoder, MXLayer)


def test_keep_first_and_last_count_the_blocks_of_a_sequential_model():
    """``nn.Sequential(embedding, 4 blocks, head)``: ``nvfp4`` (keep_first=1, keep_last=1) keeps items 1 and 4,
    the first and last blocks; the embedding (item 0) and the head (item 5, a layer itself) are not blocks."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(128, 64), *(Block() for _ in range(4)), nn.Linear(64, 128))
    rep = mxtrain.convert(model, "nvfp4")
    assert sorted(rep.kept) == ["1.fc1", "1.fc2", "4.fc1", "4.fc2"]
    assert rep.converted == ["2.fc1", "2.fc2", "3.fc1", "3.fc2", "5"]
    assert "keep_last=1 of 4 blocks" in rep.kept["4.fc1"] and "5 (64 -> 128)" in str(rep)


def test_lazy_layers_are_refused_before_anything_changes():
    model = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 64))
    with pytest.raises(ValueError, match="0.weight is an uninitialized parameter.*forward pass first"):
        mxtrain.convert(model, "mxfp4-all")
    assert not any(isinstance(m, MXLayer) for m in model.modules())
    model(torch.randn(2, 32))
    assert mxtrain.convert(model, "mxfp4-all").converted == ["0", "2"]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_a_quantized_layer_refuses_non_float_inputs(dtype):
    """``nn.Linear`` refuses them; a quantized layer must not truncate integers or drop imaginary parts."""
    layer = mxtrain.MXLinear(64, 64, recipe="mxfp4-all")
    x = torch.ones(4, 64).to(dtype)
    with pytest.raises(TypeError, match=f"the input is {dtype}.*floating-point"):
        layer(x)
    with pytest.raises(TypeError, match="floating-point"):
        mxtrain.mx_linear(x, layer.weight, None, "mxfp4-all")
    with pytest.raises(TypeError, match="floating-point"):
        torch.compile(layer, backend="eager")(x)


def test_set_step_refuses_negative_steps():
    m = _seq()
    with pytest.raises(ValueError, match="non-negative"):
        mxtrain.set_step(m, -1)


def test_report_says_what_runs_the_layers():
    """``ConvertReport.runs_as``: the route of the converted layers on their device, eagerly and compiled (the
    same answers as ``linear.implementation``), in the printed report; nothing for weights on the meta device."""
    import mxtrain
    from mxtrain.linear import implementation
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 64))
    rep = mxtrain.convert(m, "mxfp4-all-dh16")
    x, w = torch.zeros(1, 64), m[0].weight.detach()
    assert rep.runs_as == {"device": "cpu", "eager": implementation("mxfp4-all-dh16", x, w, compiled=False),
                           "compiled": implementation("mxfp4-all-dh16", x, w, compiled=True)}
    assert "reference" in rep.runs_as["eager"] and "on cpu: eagerly" in str(rep)
    assert "F.linear" in mxtrain.convert(torch.nn.Sequential(torch.nn.Linear(8, 8)), "bf16").runs_as["eager"]
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert mxtrain.convert(meta, "mxfp4-all").runs_as == {}
