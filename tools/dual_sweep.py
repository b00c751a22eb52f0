"""The one-read quantize of both operands (``quantize_mxfp4_dual``) at the 125M model's shapes, against a copy of
the same tensor and across launch configurations: where the dual pass stands against memory bandwidth at small
widths, and whether another configuration is faster there (the defaults, ``launch.DUAL_CONFIG``, were chosen at
8B shapes).

Cases, as ``mxfp4-all-dh16`` quantizes them in a step (``linear/fast.py``, ``_quant_pair``): ``X`` (A: the Fprop
operand along rows, FP8 carrier; B: the Wgrad operand along tokens as packed FP4 codes and E8M0 scales, kept for
the backward) and ``dY`` (A: the Dgrad operand, B: the Wgrad operand, both carriers), H16 on both sides, bf16
input of 16,384 tokens and 768, 1,280, 2,048 and 4,096 features. For each: GPU time by ``triton.testing.do_bench``
(us), the bytes it moves (bf16 read, carrier 1 B, packed codes 0.5 B, scales) and that as a share of a bf16
``copy_`` of the same tensor timed in the same run; then the sweep of (A block rows, B block rows, warps), and the
register cap (``qmaxnreg``) at the default configuration; and the carrier rebuild of X's B side
(``kernels.expand.carrier_from_packed``, the backward's ``_expand_kernel``). Stops starting new measurements after
``--budget`` seconds; the JSON is rewritten after each one.

``--what expand``: only the carrier rebuild, both group layouts (1x128: eager X; 128x128: the compiled layer's
X), each checked byte for byte against the fused quantizer's own carrier of the same operand.

``--what tseng``: the ``tseng`` recipe's backward passes (H64 with per-step signs, stochastic rounding, prescale
3/4; the ``tile`` layout, which takes every 64-wide rotation): dY along rows (Dgrad; on the CPU, compiled for sm_90,
255 registers uncapped, so 8 warps an SM) with register caps 168 and 128 against none, and dY and X along tokens
and W along N (Wgrad, Dgrad; 74-89 barriers a program; X's Wgrad pass is dY's launch at X's widths) at 8 warps
against the default 4 (W: 4 against 8), at
``--tokens`` x the widths of ``--dy-widths`` (8B: ``--tokens 16384 --dy-widths 4096,14336``), each checked byte
for byte against the default launch and timed against a copy.

``--what weights``: a weight's Fprop (along K, ``blocks``) and Dgrad (along N, ``cols``) passes in 128x128 groups
from its float32 master, as ``mxfp4-all-dh16`` (H16), ``mxfp4-all-rht16`` (H16 with random signs) and
``mxfp4-all-adaptive`` (the adaptive scale rule) make them, at the 125M model's and Llama-8B's weight shapes: the
default launch (128-row tiles, 8 warps, the 80-register cap) against 16 warps along K (4 along N: the ``cols``
tile's other shape), and each without the cap (on the
CPU, compiled for sm_90, the 8-warp signed and adaptive passes spill: ``tools/compile_check.py``), each against a
copy of the weight.

``--what cols``: the cols layout's spread of its tile over threads (setting ``qcols``): the compiled layer's dual
passes (the ``compiled`` cases) and a weight's Dgrad pass at the 125M-class shapes, each under ``pairs`` with the
eager launch's register cap, ``pairs`` uncapped (as inductor compiles it) and ``singles``, checked byte for byte.

``--what grouped``: whether weights quantized in one launch a shape (issue #45's "weights quantized in grouped
launches") would save device time: G weights of one shape (the 125M-class model's four, G = 4 and 12 blocks), each
pass along K and along N, in G launches against one launch over their stack, timed from CUDA graphs (the stack's
launch is what a grouped launch would run; each weight's outputs in it are checked against its own launch's); then the
group kernel itself (``quantize_mxfp4_group``, setting ``w_group``) on one and three blocks' four weights, against one
launch each, checked byte for byte.

``--what compiled``: the dual passes as the layer compiled into the graph launches them in a step of the 125M
models (``linear/compiledmx.py``): X with its Wgrad operand as an FP8 carrier in 128x128 groups (``wgrad_x=auto``
keeps the carrier up to 2,048 input features) at the layers' input widths (768, 2,048), dY with both carriers
at their output widths (768, 1,280, 4,096); the default configuration, then the same with one program a 128x128
block (``sequential``) and with other register caps (``qmaxnreg`` 0: none, 64, 72, 96; the default 80), then
every (A block rows, B block rows, warps) the kernel takes, each against a copy; and each side alone through the
single-pass kernel (where the dual pass's time goes); and the A side's other tile arrangements (setting
``qblocks``: ``rows``, ``rows16``; the default, ``auto``, is ``lanes`` for these passes), in the dual pass and
alone, right after the defaults.

    python tools/dual_sweep.py OUT.json [--budget 400] [--quick] [--what dual,expand,compiled,weights,grouped,tseng,cols]
                                        [--tokens 16384] [--x-widths 768,2048] [--dy-widths 768,1280,4096]

The Hugging Face Llama of docs/library.md (8,192 tokens a step): ``--what compiled --tokens 8192 --x-widths 1024
--dy-widths 512,1024,2816``.
"""
import argparse, itertools, json, time

import torch
import triton

from mxtrain import settings
from mxtrain.kernels import mxfp4 as kq
from mxtrain.kernels.expand import carrier_from_packed
from mxtrain.kernels.mxfp4.launch import DUAL_CONFIG

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("out")
ap.add_argument("--budget", type=float, default=400.0, help="seconds after which no new measurement starts")
ap.add_argument("--quick", action="store_true", help="one shape, two configurations (a smoke test)")
ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script under TRITON_INTERPRET=1")
ap.add_argument("--what", default="dual,expand",
                help="dual, expand, compiled, weights, grouped, tseng, cols (comma-separated)")
ap.add_argument("--timer", choices=("events", "graph"), default=None,
                help="events: triton's do_bench, one launch between two events, the L2 cache flushed before each "
                     "(at small sizes the host's launch time, not the kernel's); graph: do_bench_cudagraph, the "
                     "launches replayed from a CUDA graph (device time only; inputs of up to 50 MB may stay in "
                     "L2, for the copy alike). Default: graph where --what is compiled, grouped or both, else events")
ap.add_argument("--tokens", type=int, default=16384, help="rows of every input (tokens a step)")
ap.add_argument("--x-widths", default="768,2048",
                help="--what compiled: X's widths (the layers' input features; wgrad_x=auto keeps X's Wgrad "
                     "carrier up to 2,048 of them). The Hugging Face Llama of docs/library.md: 1024")
ap.add_argument("--dy-widths", default="768,1280,4096",
                help="--what compiled: dY's widths (the layers' output features). The Hugging Face Llama of "
                     "docs/library.md, 8,192 tokens a step: 512,1024,2816")
args = ap.parse_args()
t0 = time.time()
dev = args.device


def _widths(text: str) -> tuple:
    try:
        ws = tuple(int(w) for w in text.split(","))
    except ValueError:
        ws = ()
    if not ws or any(w < 128 or w % 128 for w in ws):
        raise SystemExit(f"dual_sweep: widths are comma-separated multiples of 128, got {text!r}")
    return ws


if args.tokens < 128 or args.tokens % 128:
    raise SystemExit(f"dual_sweep: --tokens must be a multiple of 128, got {args.tokens}")
X_WIDTHS, DY_WIDTHS = _widths(args.x_widths), _widths(args.dy_widths)
M = (64 if dev == "cpu" else 2048) if args.quick else args.tokens
WIDTHS = (((256,) if dev == "cpu" else (768,)) if args.quick else
          tuple(sorted(set((768, 1280, 2048, 4096) if not set(args.what.split(",")) <= {"compiled", "cols"} else ())
                       | set(X_WIDTHS)
                       | set(DY_WIDTHS))))
CASES = {"X": (dict(rot=16), dict(rot=16), True), "dY": (dict(rot=16), dict(rot=16), False),
         "X128": (dict(rot=16), dict(rot=16, group_rows=128), False)}   # (--what compiled)
EAGER = ("X", "dY")                                # --what dual: the eager layer's passes
COMPILED = {"X128": X_WIDTHS, "dY": DY_WIDTHS}   # (every width among WIDTHS)
res = {"env": {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
               "default_config": {str(k): v for k, v in DUAL_CONFIG.items()}}, "rows": []}


def save():
    json.dump(res, open(args.out, "w"), indent=1)


TIMER = args.timer or ("graph" if set(args.what.split(",")) <= {"compiled", "grouped", "cols"} else "events")
res["env"]["timer"] = TIMER


def bench(fn) -> float:
    if dev != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    if TIMER == "graph":
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def moved(K: int, fp4_b: bool, gr_b: int = 1) -> int:
    """Bytes the dual pass reads and writes for an (M, K) bf16 input (scales and group scales included)."""
    a = M * K * (1 + 4 / 128)                     # carrier + float32 1x128 group scales
    b = M * K * (0.5 + 1 / 32) if fp4_b else M * K * (1 + 4 / gr_b / 128)
    return int(2 * M * K + a + b)


def row(**kw):
    kw["t"] = round(time.time() - t0, 1)
    print(kw, flush=True)
    res["rows"].append(kw)
    save()


cnt = torch.zeros(1, dtype=torch.int32, device=dev)
xs = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in WIDTHS}
copy_us = {}
for K, x in xs.items():
    y = torch.empty_like(x)
    copy_us[K] = bench(lambda: y.copy_(x))
    row(what="copy", K=K, us=copy_us[K], tb_s=4 * M * K / copy_us[K] / 1e6)


def dual(case, K, block_rows=None, num_warps=None, maxnreg=None, sequential=None, form=None, cols=None):
    a, b, fp4_b = CASES[case]
    x = xs[K]
    sa = dict(a, index_strides=(K, 1))
    sb = dict(b, index_strides=(1, K))
    ov = dict(dual="on") if maxnreg is None else dict(dual="on", qmaxnreg=maxnreg)
    if form is not None:   # the A side's tile arrangement (setting qblocks)
        ov["qblocks"] = form
    if cols is not None:   # the B side's values a thread (setting qcols)
        ov["qcols"] = cols
    with settings.override(**ov):
        fn = lambda: kq.quantize_mxfp4_dual(x, sa, sb, k_multiple=512, counter=cnt, fp4_b=fp4_b,
                                            block_rows=block_rows, num_warps=num_warps, sequential=sequential)
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        us = bench(fn)
    by = moved(K, fp4_b, b.get("group_rows", 1))
    return dict(what="dual", case=case, K=K, block_rows=block_rows, num_warps=num_warps, maxnreg=maxnreg,
                sequential=sequential, form=form or settings.current().qblocks,
                cols=cols or settings.current().qcols, us=us,
                tb_s=by / us / 1e6, of_copy=(by / us) / (4 * M * K / copy_us[K]))


def sweep(points) -> None:
    """Time the dual pass at each (case, width, (A block rows, B block rows), warps) until the budget is spent; a
    configuration the kernel refuses or that does not compile is a row with its error."""
    for case, K, br, nw in points:
        if time.time() - t0 > args.budget:
            row(what="stopped", why=f"budget of {args.budget} s spent")
            return
        try:
            row(**dual(case, K, block_rows=br, num_warps=nw))
        except Exception as e:   # noqa: BLE001 - reported per configuration
            row(what="dual", case=case, K=K, block_rows=br, num_warps=nw, error=f"{type(e).__name__}: {e}"[:300])


def cols_case(x, run, label, **kw):
    """Time ``run()`` (one quantize call) under ``qcols`` ``pairs`` with the eager launch's register cap, ``pairs``
    without it (as inductor compiles the kernels), and ``singles`` (launched uncapped), after checking that
    ``singles`` writes ``pairs``' bytes."""
    outs = {}
    for cols, cap in (("pairs", None), ("pairs", 0), ("singles", None)):
        ov = dict(dual="on", qcols=cols, **({} if cap is None else {"qmaxnreg": cap}))
        with settings.override(**ov):
            got = run()
            if dev == "cuda":
                torch.cuda.synchronize()
            us = bench(run)
        outs.setdefault(cols, got)
        same = True
        for i, (p, q) in enumerate(zip(outs["pairs"], got)):
            for f in ("carrier", "gscale", "packed", "scales", "inexact"):
                u, v = getattr(p, f), getattr(q, f)
                if (u is None) != (v is None) or (u is not None and not torch.equal(
                        u.view(torch.uint8) if f == "carrier" else u, v.view(torch.uint8) if f == "carrier" else v)):
                    same = False
        row(what="cols", case=label, cols=cols, maxnreg=cap, same=same, us=us, **kw)


if "cols" in args.what:
    # the dual passes of the compiled layer and a weight's Dgrad pass (along N, 128x128 groups, from float32)
    for case, widths in COMPILED.items():
        for K in (widths if not args.quick else WIDTHS[:1]):
            if time.time() - t0 > args.budget:
                break
            a, b, fp4_b = CASES[case]
            x = xs[K]
            sa, sb = dict(a, index_strides=(K, 1)), dict(b, index_strides=(1, K))
            cols_case(x, lambda: kq.quantize_mxfp4_dual(x, sa, sb, k_multiple=512, counter=cnt, fp4_b=fp4_b),
                      f"dual {case}", K=K, copy_us=copy_us[K])
    wshapes = [(768, 768), (2304, 768), (4096, 768), (768, 2048)] if dev == "cuda" and not args.quick else [(256, 256)]
    for N, K in wshapes:
        if time.time() - t0 > args.budget:
            break
        w = torch.randn(N, K, device=dev)
        cols_case(w, lambda: (kq.quantize_mxfp4_2d(w, 0, rot=16, carrier=True, fp4=False, group_rows=128,
                                                    k_multiple=512, counter=cnt),),
                  "weight along N", N=N, K=K)
    save()


if "dual" in args.what:
    # the defaults at every width, the two single passes, the carrier rebuild
    for case, K in itertools.product(EAGER, WIDTHS):
        row(**dual(case, K))
    for K in WIDTHS:
        x = xs[K]
        with settings.override(dual="on"):
            a = kq.quantize_mxfp4_dual(x, dict(rot=16, index_strides=(K, 1)), dict(rot=16, index_strides=(1, K)),
                                       k_multiple=512, counter=cnt, fp4_b=True)[1]
            us = bench(lambda: carrier_from_packed(a, 512))
        row(what="expand (X's Wgrad carrier from codes)", K=K, us=us, tb_s=M * K * (0.5 + 1 / 32 + 1 + 4 / 128) / us / 1e6)
    for case, K in itertools.product(EAGER, WIDTHS):
        a, b, fp4_b = CASES[case]
        x = xs[K]
        sa, sb = dict(a, index_strides=(K, 1)), dict(b, index_strides=(1, K))
        two = lambda: (kq.quantize_mxfp4_2d(x, 1, **sa, carrier=True, fp4=False, k_multiple=512, counter=cnt),
                       kq.quantize_mxfp4_2d(x, 0, **sb, carrier=not fp4_b, fp4=fp4_b, k_multiple=512, counter=cnt))
        two()
        row(what="two passes", case=case, K=K, us=bench(two))

    # the sweep: (A block rows, B block rows, warps), at 768 and 4096 features
    configs = [((32, 64), 4), ((64, 128), 8)] if args.quick else [
        (br, nw) for br in ((16, 64), (32, 64), (64, 64), (32, 128), (64, 128), (128, 128)) for nw in (2, 4, 8)
        if 4 * br[1] % (32 * nw) == 0 and 4 * br[1] // (32 * nw) in (2, 4, 8, 16)]
    sweep((case, K, br, nw) for (br, nw), case, K in itertools.product(configs, EAGER, (WIDTHS[0], WIDTHS[-1])))
    for cap, case, K in itertools.product((0, 96, 128), EAGER, (WIDTHS[0], WIDTHS[-1])):
        if time.time() - t0 > args.budget:
            break
        row(**dual(case, K, maxnreg=cap))


def expand_case(K, gr):
    """Time ``carrier_from_packed`` of X's Wgrad operand (16,384 tokens x K features, H16) with group rows ``gr``,
    after checking its bytes against the fused quantizer's carrier of the same operand."""
    x = xs[K]
    side = dict(rot=16, group_rows=gr, index_strides=(1, K))
    ref = kq.quantize_mxfp4_2d(x, 0, **side, carrier=True, fp4=True, k_multiple=512, counter=cnt)
    codes = kq.QuantOut(ref.R, ref.K, None, None, gr, None, ref.packed, ref.scales)
    got = carrier_from_packed(codes, 512)
    same = bool(torch.equal(got.carrier.view(torch.uint8), ref.carrier.view(torch.uint8))
                and torch.equal(got.gscale, ref.gscale))
    us = bench(lambda: carrier_from_packed(codes, 512))
    return dict(what="expand", K=K, group_rows=gr, same=same, us=us, tb_s=M * K * (0.5 + 1 / 32 + 1) / us / 1e6,
                of_copy=(M * K * 1.53 / us) / (4 * M * K / copy_us[K]))


if "compiled" in args.what:
    # the compiled layer's cases: the default configuration at every width, then the sweep
    for case, widths in COMPILED.items():
        for K in (widths if not args.quick else WIDTHS[:1]):
            row(**dual(case, K))
            # each side alone, as the single-pass kernel makes it (where the dual pass's time goes)
            a, b, fp4_b = CASES[case]
            x = xs[K]
            for side, axis, opts, fp4 in (("A", 1, dict(a, index_strides=(K, 1)), False),
                                          ("B", 0, dict(b, index_strides=(1, K)), fp4_b)):
                fn = lambda: kq.quantize_mxfp4_2d(x, axis, **opts, carrier=not fp4, fp4=fp4, k_multiple=512,
                                                  counter=cnt)
                fn()
                us = bench(fn)
                by = M * K * (2 + ((0.5 + 1 / 32) if fp4 else (1 + 4 / opts.get("group_rows", 1) / 128)))
                row(what="single side", case=case, side=side, K=K, us=us, tb_s=by / us / 1e6,
                    of_copy=(by / us) / (4 * M * K / copy_us[K]))
    # the A side's other tile arrangements (setting qblocks: rows, rows16; the default auto is lanes here), in the
    # dual pass and alone
    for case, widths in COMPILED.items():
        for K in (widths if not args.quick else WIDTHS[:1]):
            a = CASES[case][0]
            for form in ("rows", "rows16"):
                if time.time() - t0 > args.budget:
                    break
                row(**dual(case, K, form=form))
                with settings.override(qblocks=form):
                    fn = lambda: kq.quantize_mxfp4_2d(xs[K], 1, **dict(a, index_strides=(K, 1)), carrier=True,
                                                      fp4=False, k_multiple=512, counter=cnt)
                    fn()
                    us = bench(fn)
                by = M * K * (2 + 1 + 4 / 128)
                row(what="single side", case=case, side="A", form=form, K=K, us=us, tb_s=by / us / 1e6,
                    of_copy=(by / us) / (4 * M * K / copy_us[K]))
    # the default configuration with one program a 128x128 block (A tiles, then B tiles), and with register caps
    for case, widths in COMPILED.items():
        for K in (widths if not args.quick else WIDTHS[:1]):
            if time.time() - t0 > args.budget:
                break
            row(**dual(case, K, sequential=True))
            for cap in ((0, 64, 72, 96) if not args.quick else (96,)):
                row(**dual(case, K, maxnreg=cap))
    for case in COMPILED:
        gr128 = CASES[case][1].get("group_rows", 1) == 128
        configs = [(br, nw) for bra in (16, 32, 64, 128) for brb in ((128,) if gr128 else (64, 128))
                   for br in ((bra, brb),) for nw in (2, 4, 8)
                   if 4 * brb % (32 * nw) == 0 and 4 * brb // (32 * nw) in (2, 4, 8, 16)]
        if args.quick:
            configs = configs[:2]
        sweep((case, K, br, nw) for (br, nw), K in itertools.product(configs, COMPILED[case] if not args.quick
                                                                     else WIDTHS[:1]))


def weight_case(N, K, name, opts, nw, cap):
    """Time a weight's Fprop or Dgrad pass (``opts``: axis and quantize options) at ``nw`` warps and register cap
    ``cap`` (None: the setting's default), after checking its carrier against the default launch's."""
    w = ws[(N, K)]
    ov = {} if cap is None else {"qmaxnreg": cap}
    with settings.override(**ov):
        fn = lambda: kq.quantize_mxfp4_2d(w, carrier=True, fp4=False, group_rows=128, k_multiple=512,
                                          counter=cnt, num_warps=nw, **opts)
        got = fn()
    ref = kq.quantize_mxfp4_2d(w, carrier=True, fp4=False, group_rows=128, k_multiple=512, counter=cnt, **opts)
    same = bool(torch.equal(got.carrier.view(torch.uint8), ref.carrier.view(torch.uint8))
                and torch.equal(got.gscale, ref.gscale))
    with settings.override(**ov):
        us = bench(fn)
    by = N * K * (4 + 1)
    return dict(what="weight", case=name, N=N, K=K, axis=opts["axis"], num_warps=nw, maxnreg=cap, same=same, us=us,
                tb_s=by / us / 1e6, of_copy=(by / us) / (8 * N * K / wcopy[(N, K)]))


if "weights" in args.what:
    from mxtrain.numerics.hadamard import rotation_signs
    shapes = [(768, 768), (2048, 768), (768, 2048)] + ([] if args.quick else [(4096, 4096), (14336, 4096),
                                                                                (4096, 14336)])
    if dev == "cpu":
        shapes = [(256, 256)]
    ws = {s: torch.randn(*s, device=dev) for s in shapes}
    wcopy = {}
    for s, w in ws.items():
        y = torch.empty_like(w)
        wcopy[s] = bench(lambda: y.copy_(w))
    s16 = rotation_signs(16, "fixed", seed=1, device=dev)
    WCASES = {"dh16": dict(rot=16), "rht16": dict(rot=16, signs=s16), "adaptive": dict(rot=16, scale_rule="adaptive")}
    for (N, K), (name, opts), axis in itertools.product(shapes, WCASES.items(), (1, 0)):
        alt = 16 if axis == 1 else 4   # (blocks: 16 warps, 32 values a thread; cols: 4 values a thread, 4 warps)
        for nw, cap in ((None, None), (alt, None), (None, 0), (alt, 0)):
            if time.time() - t0 > args.budget:
                break
            try:
                row(**weight_case(N, K, name, dict(opts, axis=axis), nw, cap))
            except Exception as e:   # noqa: BLE001 - reported per configuration
                row(what="weight", case=name, N=N, K=K, axis=axis, num_warps=nw, maxnreg=cap,
                    error=f"{type(e).__name__}: {e}"[:300])
    save()


def grouped_case(N, K, G, axis):
    """Time ``G`` weights of one shape quantized in ``G`` launches (the compiled layer's weight passes, one a
    layer) against one launch over the ``(G N, K)`` stack of them: a grouped launch's device time, measured with the
    existing kernel (N a multiple of 128, so that no 128x128 group straddles two weights). Checks that each weight's
    carrier and group scales in the stacked launch equal its own launch's (its real region: along N a weight's own
    launch pads its reduction to a multiple of 512, the stack only the whole). H16 as ``mxfp4-all-dh16``, float32
    masters, 128x128 groups."""
    g = torch.Generator(device=dev).manual_seed(N + K + G)
    parts = [torch.randn(N, K, device=dev, generator=g) for _ in range(G)]
    stack = torch.cat(parts)
    kw = dict(rot=16, carrier=True, fp4=False, group_rows=128, k_multiple=512, counter=cnt)
    sep = [kq.quantize_mxfp4_2d(w, axis, **kw) for w in parts]
    one = kq.quantize_mxfp4_2d(stack, axis, **kw)
    car, gs = one.carrier.view(torch.uint8), one.gscale
    same = True
    for i, q in enumerate(sep):
        c, s_ = q.carrier.view(torch.uint8), q.gscale
        if axis == 1:   # rows are N: weight i's rows i N ... (i + 1) N
            same &= torch.equal(car[i * N:(i + 1) * N], c[:N]) and torch.equal(
                gs[i * N // 128:(i + 1) * N // 128], s_[:N // 128])
        else:           # the reduction runs along N: weight i's columns
            same &= torch.equal(car[:K, i * N:(i + 1) * N], c[:K, :N]) and torch.equal(
                gs[:, i * N // 128:(i + 1) * N // 128], s_[:, :N // 128])
    us_sep = bench(lambda: [kq.quantize_mxfp4_2d(w, axis, **kw) for w in parts])
    us_one = bench(lambda: kq.quantize_mxfp4_2d(stack, axis, **kw))
    y = torch.empty_like(stack)
    us_copy = bench(lambda: y.copy_(stack))
    return dict(what="grouped", N=N, K=K, G=G, axis=axis, same=bool(same), us_separate=us_sep, us_grouped=us_one,
                us_copy=us_copy, grouped_vs_separate=us_one / us_sep)


def group_kernel_case(shapes, axis):
    """Time the weights of ``shapes`` (float32, H16, 128x128 groups) quantized one launch each against the group
    launches of ``quantize_mxfp4_group`` (``_mxfp4_group_kernel``, up to 4 a launch: the compiled layer's ``w_group``),
    after checking each weight's carrier and group scales from the group launch against its own launch's."""
    g = torch.Generator(device=dev).manual_seed(len(shapes) + axis)
    parts = [torch.randn(N, K, device=dev, generator=g) for N, K in shapes]
    kw = dict(rot=16, group_rows=128, k_multiple=512, counter=cnt)
    sep = [kq.quantize_mxfp4_2d(w, axis, carrier=True, fp4=False, **kw) for w in parts]
    grp = kq.quantize_mxfp4_group(parts, axis, **kw)
    same = all(torch.equal(a.carrier.view(torch.uint8), b.carrier.view(torch.uint8)) and torch.equal(a.gscale, b.gscale)
               for a, b in zip(sep, grp))
    us_sep = bench(lambda: [kq.quantize_mxfp4_2d(w, axis, carrier=True, fp4=False, **kw) for w in parts])
    us_grp = bench(lambda: kq.quantize_mxfp4_group(parts, axis, **kw))
    return dict(what="group kernel", shapes=[list(s) for s in shapes], axis=axis, same=bool(same),
                us_separate=us_sep, us_group=us_grp, group_vs_separate=us_grp / us_sep)


def tseng_case(name, x, axis, opts, cap=None, nw=None):
    """Time one of ``tseng``'s passes with register cap ``cap`` on the tile kernel (launch options patched: the
    stochastic-rounding launches run uncapped otherwise) and ``nw`` warps, after checking its carrier and group
    scales against the default launch's; launch plans off (they key on neither)."""
    from mxtrain.kernels.mxfp4 import launch as L
    real = L.launch_opts
    kw = dict(carrier=True, fp4=False, k_multiple=512, counter=cnt, **opts)
    with settings.override(fast_launch="off"):
        ref = kq.quantize_mxfp4_2d(x, axis, **kw)
        if cap is not None:
            L.launch_opts = lambda kern, dev, sr=False, maxnreg=None: (
                {"maxnreg": cap} if kern == "tile" else real(kern, dev, sr=sr, maxnreg=maxnreg))
        try:
            fn = lambda: kq.quantize_mxfp4_2d(x, axis, num_warps=nw, **kw)
            got = fn()
            us = bench(fn)
        finally:
            L.launch_opts = real
    same = bool(torch.equal(got.carrier.view(torch.uint8), ref.carrier.view(torch.uint8))
                and torch.equal(got.gscale, ref.gscale))
    n = x.numel()
    by = n * (x.element_size() + 1)
    return dict(what="tseng", case=name, shape=list(x.shape), axis=axis, maxnreg=cap, num_warps=nw, same=same,
                us=us, tb_s=by / us / 1e6, of_copy=(by / us) / (2 * n * x.element_size() / tcopy[tuple(x.shape)]))


if "tseng" in args.what:
    from mxtrain.kernels.mxfp4.launch import kernel_for
    from mxtrain.numerics import rng
    from mxtrain.numerics.hadamard import rotation_signs
    s64 = rotation_signs(64, "fixed", seed=2, device=dev)
    sr = dict(rot=64, signs=s64, rounding="stochastic", prescale=0.75, key=rng.stream_key(3))
    tcopy = {}
    Ns = (256,) if dev == "cpu" else (DY_WIDTHS[:1] if args.quick else DY_WIDTHS)
    Mt = 128 if dev == "cpu" else M
    for N in Ns:
        y = torch.randn(Mt, N, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, N, device=dev)
        for t in (y, w):
            z = torch.empty_like(t)
            tcopy[tuple(t.shape)] = bench(lambda: z.copy_(t))
        assert kernel_for(1, 64) == "tile" and kernel_for(0, 64, rows_contiguous=True) == "tile"
        for name, x, axis, opts, configs in (
                ("dY along rows", y, 1, sr, ((None, None), (168, None), (128, None))),
                ("dY along tokens", y, 0, sr, ((None, None), (None, 8))),
                ("W along N", w, 0, dict(sr, group_rows=128), ((None, None), (None, 4)))):
            for cap, nw in configs:
                if time.time() - t0 > args.budget:
                    break
                try:
                    row(**tseng_case(name, x, axis, opts, cap, nw))
                except Exception as e:   # noqa: BLE001 - reported per configuration
                    row(what="tseng", case=name, shape=list(x.shape), maxnreg=cap, num_warps=nw,
                        error=f"{type(e).__name__}: {e}"[:300])
    save()


if "grouped" in args.what:
    # the weight shapes of 125m-fused (q|k|v, o, gate|up, down; 4 of its blocks and all 12), each weight's pass
    # along K (Fprop) and along N (Dgrad)
    gshapes = [(2304, 768), (768, 768), (4096, 768), (768, 2048)] if dev == "cuda" else [(256, 256)]
    groups = (4, 12) if dev == "cuda" and not args.quick else (2,)
    for (N, K), G, axis in itertools.product(gshapes, groups, (1, 0)):
        if time.time() - t0 > args.budget:
            row(what="stopped", why=f"budget of {args.budget} s spent")
            break
        row(**grouped_case(N, K, G, axis))
    # the group kernel itself on one block's four weights of 125m-fused (q|k|v, o, gate|up, down), and three blocks'
    block = [(2304, 768), (768, 768), (4096, 768), (768, 2048)] if dev == "cuda" else [(256, 256), (128, 384)]
    for shapes, axis in itertools.product((block, block * 3), (1, 0)):
        if time.time() - t0 > args.budget:
            break
        row(**group_kernel_case(shapes, axis))
    save()


if "expand" in args.what:
    for gr, K in itertools.product((1, 128), WIDTHS):
        if time.time() - t0 > args.budget:
            row(what="stopped", why=f"budget of {args.budget} s spent")
            break
        row(**expand_case(K, gr))
save()
