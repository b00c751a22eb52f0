"""Device-side per-call seeds (``mxtrain.kernels.seeds``) vs the host reference: bit-identical keys and signs.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is imported).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from mxtrain.numerics import rng  # noqa: E402
from mxtrain.numerics.hadamard import rotation_signs  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels.seeds import call_seeds, call_seeds_host  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable (set TRITON_INTERPRET=1 on CPU)")

OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
SEEDS = (0, 1, 2**31 + 5, 2**40 + 3, -1, -(2**35))
LAYERS = (0, 1, 37)
STEPS = (0, 5, 2**33 + 1)
CALLS = (0, 3)
SR_MASKS = ((True,) * 6, (False,) * 6, (True, False, False, True, True, False))
# every mode at every size, and size 0 / mode none, spread over the three GEMMs
ROTATIONS = (
    (("none", "none", "none"), (0, 0, 0)),
    (("fixed", "per_layer", "per_step"), (16, 32, 64)),
    (("per_step", "fixed", "per_layer"), (128, 32, 64)),
    (("per_layer", "per_step", "fixed"), (128, 16, 64)),
    (("fixed", "per_layer", "per_step"), (128, 16, 32)),
    (("none", "none", "fixed"), (16, 128, 32)),
    (("none", "per_step", "none"), (32, 64, 0)),
)


def _i32(v):
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def _operand_key(seed, layer, i, step, call):
    """``rng.stream_key(nn.operand_seed(...))``, independently if mxtrain.linear.module does not import."""
    try:
        from mxtrain.linear.module import operand_seed
        inner = operand_seed(seed, layer, OPERANDS[i], step, call)
    except Exception:  # pragma: no cover - mxtrain.linear.module mid-edit
        inner = rng.stream_key(seed, layer, i, step, call)
    return _i32(rng.stream_key(inner))


def _state(layer, step, call):
    return torch.tensor([layer, step, call], dtype=torch.int64, device=DEV)


def _cases():
    """A deterministic spread over the grid (every value of every axis, many combinations)."""
    n = 0
    for seed in SEEDS:
        for layer in LAYERS:
            for step in STEPS:
                call = CALLS[n % 2]
                sr = SR_MASKS[n % 3]
                modes, sizes = ROTATIONS[n % len(ROTATIONS)]
                n += 1
                yield seed, layer, step, call, sr, modes, sizes


def test_matches_host_reference():
    for seed, layer, step, call, sr, modes, sizes in _cases():
        kw = dict(sr=sr, sign_modes=modes, sign_sizes=sizes)
        keys, signs = call_seeds(_state(layer, step, call), seed=seed, advance=False, **kw)
        hkeys, hsigns = call_seeds_host(seed, layer, step, call, device=DEV, **kw)
        ctx = f"seed={seed} layer={layer} step={step} call={call} sr={sr} modes={modes} sizes={sizes}"
        assert keys.dtype == torch.int32 and keys.shape == (24,), ctx
        assert signs.dtype == torch.float32 and signs.shape == (3, 128), ctx
        assert torch.equal(keys, hkeys), ctx
        assert torch.equal(signs, hsigns), ctx


def test_host_reference_spec():
    """The host reference against its definition: operand keys and rotation_signs rows."""
    sr = SR_MASKS[2]
    modes, sizes = ROTATIONS[4]
    for seed in SEEDS:
        keys, signs = call_seeds_host(seed, 37, 2**33 + 1, 3, sr=sr, sign_modes=modes, sign_sizes=sizes)
        want = [0] * 24
        for i in range(6):
            if sr[i]:
                want[4 * i] = _operand_key(seed, 37, i, 2**33 + 1, 3)
        assert keys.tolist() == want
        for g in range(3):
            if modes[g] == "none":
                assert torch.equal(signs[g], torch.ones(128))
            else:
                ref = rotation_signs(sizes[g], modes[g], seed=seed, layer=37, gemm=g, step=2**33 + 1)
                assert torch.equal(signs[g, :sizes[g]], ref)
                assert torch.equal(signs[g, sizes[g]:], torch.ones(128 - sizes[g]))


def test_operand_keys():
    for seed in (0, -1, 2**40 + 3):
        for layer, step, call in ((0, 0, 0), (37, 2**33 + 1, 3)):
            keys, _ = call_seeds(_state(layer, step, call), seed=seed, sr=(True,) * 6,
                                 sign_modes=("none",) * 3, sign_sizes=(0, 0, 0), advance=False)
            want = [0] * 24
            for i in range(6):
                want[4 * i] = _operand_key(seed, layer, i, step, call)
            assert keys.cpu().tolist() == want


def test_advance_and_outputs_in_place():
    kw = dict(seed=2**31 + 5, sr=SR_MASKS[2], sign_modes=ROTATIONS[1][0], sign_sizes=ROTATIONS[1][1])
    host = lambda call: call_seeds_host(kw["seed"], 1, 5, call, sr=kw["sr"], sign_modes=kw["sign_modes"],  # noqa: E731
                                        sign_sizes=kw["sign_sizes"], device=DEV)
    state = _state(1, 5, 3)
    keys_out = torch.full((24,), 7, dtype=torch.int32, device=DEV)
    signs_out = torch.full((3, 128), 9.0, device=DEV)
    for call in (3, 4, 5):
        keys, signs = call_seeds(state, advance=True, keys_out=keys_out, signs_out=signs_out, **kw)
        assert keys is keys_out and signs is signs_out
        hkeys, hsigns = host(call)  # keys of the value before the increment
        assert torch.equal(keys_out, hkeys) and torch.equal(signs_out, hsigns)
        assert state.cpu().tolist() == [1, 5, call + 1]
    keys, _ = call_seeds(state, advance=False, **kw)
    assert state.cpu().tolist() == [1, 5, 6]
    assert torch.equal(keys, host(6)[0])
    assert not torch.equal(keys, host(5)[0])


def test_rejects_bad_arguments():
    state = _state(0, 0, 0)
    kw = dict(seed=0, sr=(False,) * 6, advance=False)
    with pytest.raises(ValueError):
        call_seeds(state, sign_modes=("fixed", "none", "none"), sign_sizes=(0, 0, 0), **kw)
    with pytest.raises(ValueError):
        call_seeds(state, sign_modes=("bogus", "none", "none"), sign_sizes=(16, 0, 0), **kw)
    with pytest.raises(ValueError):
        call_seeds(state.to(torch.int32), sign_modes=("none",) * 3, sign_sizes=(0, 0, 0), **kw)
    with pytest.raises(ValueError):
        call_seeds(state, sign_modes=("none",) * 3, sign_sizes=(0, 0, 0), seed=0, sr=(True,) * 5, advance=False)


@pytest.mark.cuda
def test_cuda_graph_replays_current_call():
    """A captured launch reads state at replay: keys follow the call counter, which it advances."""
    kw = dict(seed=-(2**35), sr=SR_MASKS[2], sign_modes=ROTATIONS[2][0], sign_sizes=ROTATIONS[2][1])
    state = _state(37, 2**33 + 1, 0)
    keys = torch.empty(24, dtype=torch.int32, device=DEV)
    signs = torch.empty(3, 128, device=DEV)
    call_seeds(state, advance=True, keys_out=keys, signs_out=signs, **kw)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call_seeds(state, advance=True, keys_out=keys, signs_out=signs, **kw)
    state[2] = 1
    for call in (1, 2, 3):
        graph.replay()
        hkeys, hsigns = call_seeds_host(kw["seed"], 37, 2**33 + 1, call, sr=kw["sr"], sign_modes=kw["sign_modes"],
                                        sign_sizes=kw["sign_sizes"], device=DEV)
        assert torch.equal(keys, hkeys) and torch.equal(signs, hsigns)
        assert state.tolist() == [37, 2**33 + 1, call + 1]


def test_launch_plan_replays_with_the_current_state():
    """With launch plans on (the interpreter here, as GPUs by default) the first call of a recipe's
    arguments launches the kernel the generic way and keeps a plan (``CACHES.direct``); later calls, with a
    new state value and new outputs, go through it and still match the host reference and advance the
    state. Another recipe's arguments get a plan of their own."""
    from mxtrain import settings
    from mxtrain.kernels import CACHES
    kw = dict(seed=2**40 + 3, sr=SR_MASKS[2], sign_modes=ROTATIONS[2][0], sign_sizes=ROTATIONS[2][1])
    CACHES.direct.clear()
    try:
        with settings.override(fast_launch="always"):
            state = _state(37, 2**33 + 1, 0)
            used = []
            for call in range(3):
                keys, signs = call_seeds(state, advance=True, **kw)
                hkeys, hsigns = call_seeds_host(kw["seed"], 37, 2**33 + 1, call, sr=kw["sr"], device=DEV,
                                                sign_modes=kw["sign_modes"], sign_sizes=kw["sign_sizes"])
                assert torch.equal(keys, hkeys) and torch.equal(signs, hsigns)
                assert state.cpu().tolist() == [37, 2**33 + 1, call + 1]
                assert len(CACHES.direct) == 1
                if call == 0:   # spy on the plan made by the first call
                    (key, (run, rest)), = CACHES.direct.items()
                    CACHES.direct[key] = (lambda *a: (used.append(1), run(*a))[1], rest)
            assert used == [1, 1]
            call_seeds(state, advance=False, **dict(kw, seed=1))
            assert len(CACHES.direct) == 2 and used == [1, 1]
    finally:
        CACHES.direct.clear()
