"""The MX linear layer under ``torch.compile``, compiled into the graph (setting ``mx_compiled``).

Under ``torch.compile`` the fast path used to be opaque Python custom ops (``mxtrain::quantize_input``,
``mxtrain::linear_q``, ``mxtrain::linear_backward``) that re-made every decision at every call: about 1.2 ms of
host time a layer on a GPU server, more than the GPU work of a layer of a 125M model (BENCHMARKS.md). Here the
layer is a traced ``autograd.Function`` whose forward and backward run the layer's skeleton (``mxtrain.linear.skeleton``)
over ``_GraphBackend``, which calls the quantize kernels as ``triton_op``s
(``kernels.mxfp4.traced``: ``q_dual``, ``q_single``, ``q_expand``) and multiply the FP8 carriers with a traced
``torch._scaled_mm``. Every decision (recipe, kernel variant, grid, group rows, padding) is made once, when the
graph is traced; at run time the layer is the lines inductor's generated code holds for it: kernel launches and
GEMM calls.

It computes what the fast path computes, with the same kernels and the same GEMM calls: X's Fprop operand and
its Wgrad operand (as packed FP4 codes, 0.53 bytes an element) from one read of X (the dual kernel), W's
operands with 128x128 groups, dY's two operands from one read, X's carrier rebuilt from its codes before the
Wgrad GEMM. Outputs and gradients are the eager fast path's bit for bit (cuda tests), and the inexact-block
counts are kept as eagerly (``fast.state``).

X's operands are made outside the autograd function (``_x_operands``; they carry no gradient), so that layers
reading one input can share them: with ``mx_compiled=auto`` (the default; ``separate`` turns it off) a pass over
the graph dynamo captures
(``share_inputs``) merges their quantize calls, as the compiler merged the custom ops, and a pass over the joint
graph (``share_carriers``) the carrier each layer's backward rebuilds from the shared codes.

Which recipes: those ``spec`` describes: every operand one the fast path takes (``fast.supported``), each GEMM
either MX on both operands or plain. MX: ``mxfp4``, or the uniform 4-bit grids ``mxint4`` and ``mxe1m2``
(``carrier.KERNEL_FORMATS``: the FP8 carrier holds them exactly), any scale rule of the kernels (``adaptive``
included), round to nearest or stochastic, any prescale, no rotation or a Hadamard rotation with or without random
signs: ``mxfp4-all``, ``mxfp4-all-dh16``, ``+amd``, ``+rceil``, ``mxfp4-all-adaptive``, ``mxfp4-all-sr``,
``mxfp4-all-rht16``, ``tseng``, ``ufp4``... The format and rule of each operand go to its kernel launch (the
``GRID`` and ``RULE`` constexprs) as the eager fast path passes them. A recipe that draws random bits gets the call's keys and sign vectors from ``mxtrain::call_seeds`` (one
small op a layer, which advances the layer's call counter; activation checkpointing keeps its outputs): the
kernels read them from device memory, so CUDA graphs replay with the current step's bits, as eagerly. Those
recipes (``seeded``) with the setting ``mx_compiled_seeded`` (on; its cuda tests equal the eager fast path bit for
bit; their kernel variants compile to the eager kernels' code under inductor's contraction,
``tools/compile_check.py --fusion``); off, they keep the custom ops.
Where: CUDA tensors (float32, bfloat16, float16) on a GPU whose FP8 GEMM takes 128x128 weight groups exactly
(Hopper), the fast path on, ``exact_carrier`` off. ``mxtrain.linear.implementation`` answers which form a
compiled layer takes.
"""

from __future__ import annotations

import torch

from ._constant import assume_constant_result
from ..kernels.mxfp4 import traced as _traced  # noqa: F401  (registers mxtrain::q_single, q_dual, q_expand)
from ..numerics.quant import SCALE_RULES
from . import fast, skeleton
from .skeleton import DGRAD, FPROP, Backend
from ..kernels import backend, gemm
from ..kernels.mxfp4.traced import AVAILABLE
from ..kernels.mxfp4 import kernels as _kernels   # (_mxfp4_group_kernel: w_group's launches; read when used)
from ..kernels.mxfp4.launch import GROUP_MAX, dual_applies, group_consts
from ..kernels.mxfp4.carrier import KERNEL_FORMATS, group_values
from .. import settings

__all__ = ["applies", "linear", "plan", "spec", "seeded", "share_inputs", "SharePass", "share_carriers",
           "ShareCarrierPass", "install_share_pass", "TRACE_TIME_SETTINGS"]

_GEMMS = (("fprop", "fprop_x", "fprop_w"), ("dgrad", "dgrad_dy", "dgrad_w"), ("wgrad", "wgrad_dy", "wgrad_x"))
_TILE = 128
_OK = (torch.float32, torch.bfloat16, torch.float16)


# The settings the quantize ops' bodies read when they are traced (``launch.single_spec``, ``dual_spec``,
# ``dual_applies``, ``verify``): ``applies`` passes their values to ``plan``, so that dynamo guards on them and a
# change after a model was compiled recompiles it instead of being ignored. (``fast_launch`` and ``append`` steer
# the eager launches only.) tests/linear/test_compiledmx.py checks this list against what those modules read.
TRACE_TIME_SETTINGS = ("dual", "qkernel", "qblocks", "qcols", "qmaxnreg", "qselfcheck")


@assume_constant_result
def plan(device: str, share: bool = False, recompute: bool = False, group: bool = False, *trace_settings) -> tuple:
    """``(x_rows, w_rows)``: group rows of Wgrad's X and of the weights on ``device``, or ``(0, 0)`` where the
    compiled layer cannot run there (no FP8 tensor cores, the FP8-carrier GEMM not the device's backend,
    128x128 weight groups not exact). Makes the inexact-block counters of the device (outside any graph,
    static addresses for CUDA graphs). Called with the tracing modes off, once per graph. ``share``, ``recompute``:
    whether the compile shares inputs and recomputes X for the backward (``wgrad_x_recompute``), ``group``: whether
    it groups weight passes (``w_group``): the joint pass is installed for any. ``trace_settings``: the values of ``TRACE_TIME_SETTINGS`` (unused here: passed so that
    dynamo guards on them)."""
    d = torch.device(device)
    if d.type != "cuda" or not AVAILABLE or backend(d) != "fp8_carrier":
        return (0, 0)
    if gemm.weight_group_rows(d) != 128:
        return (0, 0)
    fast.state.prepare(d)
    if share or recompute or group:
        install_share_pass()
    return (gemm.activation_b_group_rows(d), 128)


def applies(mx: str, x: torch.Tensor, weight: torch.Tensor, s) -> tuple:
    """``plan``'s answer where the compiled layer can run this call, else ``(0, 0)``: ``mx`` from ``spec``
    (non-empty), CUDA float tensors, a 2-D weight, a non-empty input. ``s``: the settings the dispatcher read
    (``linear.compiled_form``, which decides from ``mx_compiled``, ``mx_compiled_seeded``, ``fast`` and
    ``exact_carrier`` whether to ask): whether layers share inputs (``Settings.shares_inputs``) and the launch
    settings of the kernels go to
    ``plan``, so that dynamo guards on them."""
    if not mx:
        return (0, 0)
    if x.dtype not in _OK or weight.dtype not in _OK or weight.ndim != 2:
        return (0, 0)
    if x.numel() == 0 or weight.numel() == 0:
        return (0, 0)
    # (the device is plan's to judge: it answers (0, 0) off CUDA)
    return plan(str(x.device), s.shares_inputs(), s.wgrad_x_recompute, s.w_group == "on", s.dual, s.qkernel,
                s.qblocks, s.qcols,
                s.qmaxnreg, s.qselfcheck)


def _mm(ca: torch.Tensor, ga: torch.Tensor, Ra: int, cb: torch.Tensor, gb: torch.Tensor, rows_b: int, Rb: int,
        out_dtype: torch.dtype, alpha: float = 1.0) -> torch.Tensor:
    """``A B^T`` of two carriers (``q_*``'s outputs: A with 1x128 group-scale storage (Kc/128, Rca), B with
    ``rows_b`` 1 or 128), the first ``Ra`` x ``Rb`` entries, in ``out_dtype``: the fast path's
    ``kernels.gemm.mx_gemm_nt`` (the same ``_scaled_mm`` call and scale views). ``alpha``: the output multiplier
    (1 / the prescales), folded into A's float32 group scales as the fast path folds it."""
    odt = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    Kc = ca.shape[1]
    sa = (ga * alpha).t() if alpha != 1.0 else ga.t()   # (Rca, Kc/128), outer-dim-major
    sb = gb if rows_b == 1 else gb[:, : Kc // _TILE].t()  # (Kc/128, Rcb) or (Kc/128, Rcb/128)
    if ca.device.type != "cuda":   # (the tests' emulation on a CPU: the carriers' values in float32)
        va = group_values(ca.view(torch.float8_e4m3fn), sa)
        vb = group_values(cb.view(torch.float8_e4m3fn), sb.t())
        return torch.matmul(va, vb.t())[:Ra, :Rb].to(odt).to(out_dtype)
    y = torch._scaled_mm(ca.view(torch.float8_e4m3fn), cb.view(torch.float8_e4m3fn).t(), sa, sb, out_dtype=odt)
    if y.shape[0] != Ra or y.shape[1] != Rb:
        y = y[:Ra, :Rb]
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _plain(A: torch.Tensor, axA: int, B: torch.Tensor, axB: int, out_dtype: torch.dtype,
           amp: torch.dtype | None) -> torch.Tensor:
    """A plain GEMM of the spec (``"p"``): ``op(A) op(B)^T`` reduced along the given axes of the 2-D ``A`` and
    ``B``, as the fast path computes it (``fast._gemm_fn``: bf16 operands multiplied as they are, others in the
    autocast dtype, else float32), in ``out_dtype``."""
    ta = A if axA == 1 else A.t()
    tb = B if axB == 1 else B.t()
    if A.dtype == torch.bfloat16 and B.dtype == torch.bfloat16:
        y = torch.matmul(ta, tb.t())
    else:
        gd = amp if amp is not None else torch.float32
        y = torch.matmul(ta.to(torch.float32).to(gd), tb.to(torch.float32).to(gd).t())
    return y.to(torch.float32).to(out_dtype)


def spec(recipe) -> str | None:
    """The recipe's three GEMMs as the compiled layer runs them, joined by ``;``, or None where it does not take
    the recipe: ``"p"`` plain, ``"m<rot>:<rule A>:<rule B>"`` MXFP4 with round to nearest, no random signs,
    prescale 1 and a scale rule of ``quant.SCALE_RULES``, else ``"m<rot>:<rule A>:<rule
    B>:<signs s|n>:<rounding A n|s>:<rounding B>:<prescale A>:<prescale B>"``, followed by ``":<format A>:<format
    B>"`` where an operand is not ``mxfp4`` (``mxint4``, ``mxe1m2``: ``carrier.KERNEL_FORMATS``). Every operand as
    the fast path takes it (``fast.supported``: the ``adaptive`` rule and the uniform grids included); no GEMM that
    rotates or scales high-precision operands. Depends on the recipe only."""
    if not fast.supported(recipe):
        return None
    parts, mx = [], False
    for g, a, b in _GEMMS:
        oa, ob, rot = recipe.operand(a), recipe.operand(b), recipe.rotation(g)
        if not oa.quantized and not ob.quantized and not rot.enabled and oa.prescale == ob.prescale == 1.0:
            parts.append("p")
            continue
        if oa.fmt not in KERNEL_FORMATS or ob.fmt not in KERNEL_FORMATS:
            return None   # (an MX operand against a high-precision one: the fast path runs it as the reference)
        size = rot.size if rot.enabled else 0
        signs = rot.enabled and rot.signs != "none"
        fmts = oa.fmt != "mxfp4" or ob.fmt != "mxfp4"
        head = f"m{size}:{oa.scale_rule}:{ob.scale_rule}"
        if (signs or oa.rounding != "nearest" or ob.rounding != "nearest" or oa.prescale != 1.0 or ob.prescale != 1.0
                or oa.scale_rule not in SCALE_RULES or ob.scale_rule not in SCALE_RULES or fmts):
            head += (f":{'s' if signs else 'n'}:{oa.rounding[0]}:{ob.rounding[0]}:{float(oa.prescale)!r}"
                     f":{float(ob.prescale)!r}")
        if fmts:
            head += f":{oa.fmt}:{ob.fmt}"
        parts.append(head)
        mx = True
    return ";".join(parts) if mx else None


class _G:
    """One MX GEMM of a spec: rotation size, scale rules, random signs, stochastic rounding, prescales and MX
    formats of its operands A and B."""
    __slots__ = ("rot", "ra", "rb", "signs", "sra", "srb", "pa", "pb", "fa", "fb")

    def __init__(self, g: str):
        f = g[1:].split(":")
        self.rot, self.ra, self.rb = int(f[0]), f[1], f[2]
        if len(f) > 3:
            self.signs, self.sra, self.srb = f[3] == "s", f[4] == "s", f[5] == "s"
            self.pa, self.pb = float(f[6]), float(f[7])
        else:
            self.signs = self.sra = self.srb = False
            self.pa = self.pb = 1.0
        self.fa, self.fb = (f[8], f[9]) if len(f) > 8 else ("mxfp4", "mxfp4")

    @property
    def seeded(self) -> bool:
        """Random signs, stochastic rounding or a prescale on either operand."""
        return self.signs or self.sra or self.srb or self.pa != 1.0 or self.pb != 1.0

    @property
    def alpha(self) -> float:
        """The GEMM's output multiplier, 1 / (prescale A x prescale B), as the fast path computes it."""
        return 1.0 / (self.pa * self.pb)


def seeded(mx: str) -> bool:
    """Does ``spec``'s answer ``mx`` round stochastically, draw random signs or prescale? (Its wider form also
    carries the ``adaptive`` rule and the uniform grids, which draw nothing.)"""
    return any(_G(g).seeded for g in mx.split(";") if g != "p")


def grids(mx: str) -> bool:
    """Does ``spec``'s answer ``mx`` hold an operand of a uniform 4-bit grid (``mxint4``, ``mxe1m2``) or the
    ``adaptive`` scale rule (what the setting ``mx_compiled_grids`` admits)?"""
    return any(gg.fa != "mxfp4" or gg.fb != "mxfp4" or "adaptive" in (gg.ra, gg.rb)
               for gg in (_G(g) for g in mx.split(";") if g != "p"))


def _parse(g: str) -> tuple[int, str, str]:
    rot, ra, rb = g[1:].split(":")[:3]
    return int(rot), ra, rb


# the operands' positions in ``call_seeds``' keys (``keys[4 i]``: operand ``i`` of ``recipe.OPERANDS``)
_KEY_INDEX = {"fprop_x": 0, "fprop_w": 1, "dgrad_dy": 2, "dgrad_w": 3, "wgrad_dy": 4, "wgrad_x": 5}
_GEMM_INDEX = {"fprop": 0, "dgrad": 1, "wgrad": 2}


class _Seeds:
    """The call's random inputs as the kernels take them: ``key(name)`` an int32 one-element view of ``call_seeds``'
    keys where operand ``name`` rounds stochastically, ``signs(gemm, G)`` the GEMM's sign vector where it has
    random signs; None otherwise (and always without seeds)."""
    __slots__ = ("keys", "sign_rows")

    def __init__(self, keys, sign_rows):
        self.keys, self.sign_rows = keys, sign_rows

    def key(self, name: str, sr: bool):
        if not sr or self.keys is None:
            return None
        i = 4 * _KEY_INDEX[name]
        return self.keys[i: i + 1]

    def signs(self, gemm: str, G: _G):
        if not G.signs or self.sign_rows is None:
            return None
        return self.sign_rows[_GEMM_INDEX[gemm], : G.rot]


def _dual_ok(t2: torch.Tensor, rot_a: int, rot_b: int, sr: bool = False, group_rows_a: int = 1) -> bool:
    """Does one pass make both operands of ``t2`` (``launch.dual_applies`` on the trace's tensor)?"""
    return dual_applies(t2, rot_a, rot_b, group_rows_a, sr=sr)


def _side(seeds: _Seeds, name: str, gemm: str, G: _G, a: bool) -> tuple:
    """(signs, key, rounding, prescale, MX format) of operand ``name`` (A or B of ``gemm``): ``q_single``'s last
    arguments; ``q_dual`` takes the first four of each side, then the two formats (``_dual``)."""
    sr, ps, fmt = (G.sra, G.pa, G.fa) if a else (G.srb, G.pb, G.fb)
    return seeds.signs(gemm, G), seeds.key(name, sr), "stochastic" if sr else "nearest", ps, fmt


def _dual(t2: torch.Tensor, cnt, rot_a: int, rule_a: str, rot_b: int, rule_b: str, group_rows_b: int, fp4_b: bool,
          side_a: tuple, side_b: tuple, kmul: int, group_rows_a: int = 1) -> tuple:
    """``q_dual`` of ``t2`` with A's and B's ``_side`` answers: (A's carrier, its group-scale storage, B's carrier
    or packed codes, its group-scale storage or E8M0 scales). ``group_rows_a`` 128: a weight's two operands."""
    return tuple(torch.ops.mxtrain.q_dual(t2, cnt, rot_a, rule_a, rot_b, rule_b, group_rows_b, fp4_b, kmul,
                                          *side_a[:4], *side_b[:4], side_a[4], side_b[4], group_rows_a))


def _quant_rows(t2: torch.Tensor, cnt, rot: int, rule: str, group_rows: int, kmul: int,
                side: tuple = (None, None, "nearest", 1.0, "mxfp4")):
    """``t2`` (R, K) quantized along K: (carrier, group-scale storage). ``side``: ``_side``'s answer."""
    c, g, _, _ = torch.ops.mxtrain.q_single(t2, cnt, 1, rot, rule, True, False, group_rows, kmul, *side)
    return c, g


def _quant_cols(t2: torch.Tensor, cnt, rot: int, rule: str, group_rows: int, kmul: int, fp4: bool = False,
                side: tuple = (None, None, "nearest", 1.0, "mxfp4")):
    """``t2`` (M, K) quantized along M (the operand of K rows): (carrier, group-scale storage) or, with
    ``fp4``, (packed codes, E8M0 scales)."""
    c, g, p, s = torch.ops.mxtrain.q_single(t2, cnt, 0, rot, rule, not fp4, fp4, group_rows, kmul, *side)
    return (p, s) if fp4 else (c, g)


class _GraphBackend(Backend):
    """The compiled layer's GEMMs (``skeleton.Backend``), every decision taken from the spec's strings while the graph
    is traced: a plain GEMM (``"p"``) as the fast path multiplies it (``_plain``); an MX one over ``q_*`` operands and
    the carrier GEMM (``_mm``). X's Fprop operand comes from outside the autograd function (``pre``: carrier and group
    scales, ``_x_operands``); its Wgrad operand kept from the forward (``kept``: FP4 codes and E8M0 scales, or the
    carrier and group scales with ``wgrad_x=carrier``) or quantized from the kept X in the backward. ``counters``:
    the inexact-block counters this phase adds to (x, w, dy): the backward's x and w are their own
    (``fast.COUNTERS``). No autocast context (the skeleton's ``autocast_off``): nothing here depends on autocast."""

    autocast_off = False

    def __init__(self, gemms: tuple, seeds: "_Seeds", amp, x_rows: int, kmul: int, counters: tuple, pre=None,
                 kept=None, w_pre=None):
        self.gemms, self.seeds, self.amp, self.x_rows, self.kmul, self.cnt = gemms, seeds, amp, x_rows, kmul, counters
        self.pre = {} if pre is None else {"fprop": pre}
        self.kept = kept
        # W's operands made before the GEMM asks (setting w_dual, ``_w_operands``): {"fprop": ..., "dgrad": ...}
        self.w_pre = w_pre or {}

    def start_backward(self, dy2, weight, need):
        dy2 = dy2.contiguous()
        g = self.gemms
        if need[0] and need[1] and g[1] != "p" and g[2] != "p":
            D, W = _G(g[1]), _G(g[2])
            if _dual_ok(dy2, D.rot, W.rot, D.sra or W.sra):
                a0, a1, b0, b1 = _dual(dy2, self.cnt[2], D.rot, D.ra, W.rot, W.ra, 1, False,
                                       _side(self.seeds, "dgrad_dy", "dgrad", D, True),
                                       _side(self.seeds, "wgrad_dy", "wgrad", W, True), self.kmul)
                self.pre = {"dgrad": (a0, a1), "wgrad": (b0, b1)}
        return dy2

    def gemm(self, g, a, b, final, dims):
        odt = final if final is not None else torch.float32
        spec = self.gemms[_GEMM_INDEX[g.name]]
        if spec == "p":
            return _plain(a, g.a_axis, b, g.b_axis, odt, self.amp)
        G, seeds = _G(spec), self.seeds
        cx, cw, cdy = self.cnt
        rows, cols, _ = dims
        if g is FPROP:   # (A: X's carrier from outside; B: W along its rows, 128x128 groups)
            ca, ga = self.pre["fprop"]
            cb, gb = (self.w_pre["fprop"] if "fprop" in self.w_pre else
                      _quant_rows(b, cw, G.rot, G.rb, 128, self.kmul, _side(seeds, "fprop_w", "fprop", G, False)))
            return _mm(ca, ga, rows, cb, gb, 128, cols, odt, G.alpha)
        side_a = _side(seeds, g.a, g.name, G, True)
        if g is DGRAD:   # (A: dY along its rows; B: W along its columns, 128x128 groups)
            ca, ga = (self.pre["dgrad"] if "dgrad" in self.pre else
                      _quant_rows(a, cdy, G.rot, G.ra, 1, self.kmul, side_a))
            cb, gb = (self.w_pre["dgrad"] if "dgrad" in self.w_pre else
                      _quant_cols(b, cw, G.rot, G.rb, 128, self.kmul, side=_side(seeds, "dgrad_w", "dgrad", G, False)))
            return _mm(ca, ga, rows, cb, gb, 128, cols, odt, G.alpha)
        # Wgrad (A: dY along its columns; B: X along its columns, from the kept operand or the kept X)
        ca, ga = (self.pre["wgrad"] if "wgrad" in self.pre else
                  _quant_cols(a, cdy, G.rot, G.ra, 1, self.kmul, side=side_a))
        pk, sc = self.kept if self.kept is not None else (None, None)
        if b is None and sc.dtype == torch.float32:   # (kept as its carrier: wgrad_x=carrier)
            cb, gb = pk, sc
        elif b is None:
            cb, gb = torch.ops.mxtrain.q_expand(pk, sc, cx, dims[2], self.x_rows, self.kmul, G.fb)
        else:
            cb, gb = _quant_cols(b, cx, G.rot, G.rb, self.x_rows, self.kmul,
                                 side=_side(seeds, "wgrad_x", "wgrad", G, False))
        return _mm(ca, ga, rows, cb, gb, self.x_rows, cols, odt, G.alpha)


class _CompiledMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ca, ga, pk, sc, keys, sign_rows, gemms, out_dtype, amp, x_rows, kmul,
                w_dual=False):
        """``ca``, ``ga``: X's Fprop carrier and group-scale storage; ``pk``, ``sc``: its Wgrad operand as FP4 codes
        and E8M0 scales (None: the backward quantizes the kept X); all None where Fprop is plain (``_x_operands``).
        ``keys``, ``sign_rows``: the call's random inputs (``call_seeds``), or None where the recipe draws none.
        ``w_dual``: W's Fprop and Dgrad operands from one pass here, the Dgrad one kept (setting ``w_dual``, where
        the backward computes dX: ``linear``)."""
        cx, cw, cdy = _counters(x.device)[:3]
        seeds = _Seeds(keys, sign_rows)
        w_ops = _w_operands(weight, gemms, seeds, cw, kmul) if w_dual else None
        be = _GraphBackend(gemms, seeds, amp, x_rows, kmul, (cx, cw, cdy),
                           pre=(ca, ga) if gemms[0] != "p" else None,
                           w_pre={"fprop": w_ops[0]} if w_ops is not None else None)
        y = skeleton.forward(be, x, weight, bias, out_dtype)
        ctx.gemms, ctx.amp, ctx.x_rows, ctx.kmul = gemms, amp, x_rows, kmul
        ctx.has_bias, ctx.x_dtype = bias is not None, x.dtype
        ctx.saved_codes = pk is not None
        ctx.seeded = (keys is not None, sign_rows is not None)
        seeded = tuple(t for t in (keys, sign_rows) if t is not None)
        ctx.w_kept = w_ops is not None
        w_kept = w_ops[1] if w_ops is not None else ()
        if ctx.saved_codes:
            ctx.save_for_backward(pk, sc, weight, *seeded, *w_kept)
        else:
            ctx.save_for_backward(x.reshape(-1, x.shape[-1]).contiguous(), weight, *seeded, *w_kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        n = ctx.needs_input_grad
        saved = list(ctx.saved_tensors)
        if ctx.saved_codes:
            pk, sc, weight = saved[:3]
            x2, kept = None, (pk, sc)
        else:
            x2, weight = saved[:2]
            kept = None
        rest = saved[3 if ctx.saved_codes else 2:]
        keys = rest.pop(0) if ctx.seeded[0] else None
        sign_rows = rest.pop(0) if ctx.seeded[1] else None
        w_pre = {"dgrad": (rest[0], rest[1])} if ctx.w_kept else None
        _, _, cdy, cx, cw = _counters(dy.device)   # (x and w: the counters only backward graphs write, fast.COUNTERS)
        be = _GraphBackend(ctx.gemms, _Seeds(keys, sign_rows), ctx.amp, ctx.x_rows, ctx.kmul, (cx, cw, cdy),
                           kept=kept, w_pre=w_pre)
        dx, dw, db = skeleton.backward(be, dy, x2, weight, ctx.x_dtype, (n[0], n[1], ctx.has_bias and n[2]))
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None, None


def _counters(device: torch.device) -> tuple:
    """The device's running inexact-block counters ``(x, w, dy, x.bwd, w.bwd)`` (``fast.COUNTERS``, ``fast.state``),
    which the ops add to; made by ``plan`` before the graph."""
    return fast.state.by_name[str(device)]


def _w_operands(weight: torch.Tensor, gemms: tuple, seeds: _Seeds, cnt, kmul: int):
    """W's Fprop operand (along K) and Dgrad operand (along N), both FP8 carriers in 128x128 groups, from one read
    of the weight (``q_dual`` with 128-row groups on both sides; setting ``w_dual``): ``((carrier, group-scale
    storage), (carrier, group-scale storage))``, the same bytes as the two passes the GEMMs would make
    (``_quant_rows``, ``_quant_cols``); None where Fprop or Dgrad is plain or one pass cannot make both."""
    if gemms[0] == "p" or gemms[1] == "p":
        return None
    F, D = _G(gemms[0]), _G(gemms[1])
    if not _dual_ok(weight, F.rot, D.rot, F.srb or D.srb, group_rows_a=128):
        return None
    cf, gf, cd, gd = _dual(weight, cnt, F.rot, F.rb, D.rot, D.rb, 128, False,
                           _side(seeds, "fprop_w", "fprop", F, False), _side(seeds, "dgrad_w", "dgrad", D, False),
                           kmul, group_rows_a=128)
    return (cf, gf), (cd, gd)


def _x_operands(x2: torch.Tensor, gemms: tuple, x_rows: int, need_wgrad: bool, seeds: _Seeds,
                codes: bool = True, kmul: int = 512) -> tuple:
    """X's operands, made outside the layer's autograd function (they carry no gradient; dX comes from the
    function's backward), so that layers reading one input can share them (``share_inputs``): ``(Fprop carrier,
    its group-scale storage, Wgrad operand, its scales)``, the Wgrad operand as FP4 codes and E8M0 scales
    (``codes``) or as its FP8 carrier and group-scale storage (setting ``wgrad_x=carrier``), None where the
    backward needs no Wgrad operand from the forward; all None where Fprop is plain. ``kmul``: the carriers'
    reduction multiple (setting ``carrier_k``)."""
    if gemms[0] == "p":
        return None, None, None, None
    cx = _counters(x2.device)[0]
    F = _G(gemms[0])
    fa = _side(seeds, "fprop_x", "fprop", F, True)
    if need_wgrad:
        W = _G(gemms[2])
        wb = _side(seeds, "wgrad_x", "wgrad", W, False)
        if _dual_ok(x2, F.rot, W.rot, F.sra or W.srb):
            return _dual(x2, cx, F.rot, F.ra, W.rot, W.rb, x_rows, codes, fa, wb, kmul)
        ca, ga = _quant_rows(x2, cx, F.rot, F.ra, 1, kmul, fa)
        pk, sc = _quant_cols(x2, cx, W.rot, W.rb, x_rows, kmul, fp4=codes, side=wb)
        return ca, ga, pk, sc
    ca, ga = _quant_rows(x2, cx, F.rot, F.ra, 1, kmul, fa)
    return ca, ga, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mx: str, rows: tuple,
           keys: torch.Tensor | None = None, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMMs ``spec`` described as ``mx``, as the compiled layer (``applies``'
    answer ``rows``), in the autocast dtype where autocast is on (as the fast path). ``keys``, ``signs``: the
    call's ``call_seeds`` outputs where the recipe rounds stochastically or draws random signs (else None)."""
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
    out_dtype = amp if amp is not None else x.dtype
    gemms = tuple(mx.split(";"))
    where = settings.current().wgrad_x_for(x.shape[-1])
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad and where != "backward" and gemms[2] != "p"
    x2 = x.detach().reshape(-1, x.shape[-1]).contiguous()   # (quantized operands carry no gradient)
    kmul = settings.current().carrier_k   # (read while tracing: dynamo guards on it, as on wgrad_x)
    ca, ga, pk, sc = _x_operands(x2, gemms, rows[0], need_wgrad, _Seeds(keys, signs), where == "forward", kmul)
    # W's Dgrad operand made with its Fprop one where the backward will compute dX (setting w_dual; read while
    # tracing: dynamo guards on it)
    w_dual = (settings.current().w_dual == "on" and torch.is_grad_enabled() and x.requires_grad)
    return _CompiledMXLinear.apply(x, weight, bias, ca, ga, pk, sc, keys, signs, gemms, out_dtype, amp, rows[0], kmul,
                                   w_dual)


# ---------------------------------------------------------------------------------------------- shared inputs

_PURE_METHODS = ("detach", "reshape", "view", "contiguous", "flatten")


def _freeze(v):
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(a) for a in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(a)) for k, a in v.items()))
    if isinstance(v, torch.fx.Node):
        return ("node", v)
    if v is None or isinstance(v, (int, float, str, bool, torch.dtype, torch.device)):
        return (type(v).__name__, v)
    return ("object", id(v))


def share_inputs(graph: torch.fx.Graph) -> int:
    """Merge the calls of ``mxtrain::q_dual`` and ``mxtrain::q_single`` that quantize one input the same way (the
    layers of separate q/k/v or gate/up projections), with the views of the input that lead to them: the input is
    quantized once, its Wgrad operand kept once for the backward, and its inexact blocks counted once (as the eager
    fast path's activation reuse does). A pass over the graph dynamo captured (inductor's pre-grad custom pass),
    where these calls are still ops: later, each is output allocations and a kernel launch, which the compiler
    does not merge. Calls that read a tensor written in place between them are not merged. Returns the number of
    nodes removed."""
    import operator
    ops = (torch.ops.mxtrain.q_dual, torch.ops.mxtrain.q_single,                   # (dynamo records the packets)
           torch.ops.mxtrain.q_dual.default, torch.ops.mxtrain.q_single.default)
    seen: dict = {}
    plan = []
    for node in graph.nodes:
        if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") and node.args:
            t = node.args[0]   # written in place: its readers seen so far are not merged with later ones
            seen = {k: v for k, v in seen.items() if t not in v[1]}
            continue
        if not ((node.op == "call_method" and node.target in _PURE_METHODS)
                or (node.op == "call_function" and (node.target in ops or node.target is operator.getitem))):
            continue
        key = (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))
        hit = seen.get(key)
        if hit is not None:
            plan.append((node, hit[0]))
            # (later nodes name the kept node in their keys)
            node.replace_all_uses_with(hit[0])
        else:
            seen[key] = (node, set(node.all_input_nodes))
    for node, _ in reversed(plan):
        graph.erase_node(node)
    return len(plan)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover - torch without custom graph passes
    _PassBase = object


class _ChainedPass(_PassBase):
    """An inductor custom graph pass that runs the pass a user had set (``before``) and then ``run``, with a
    ``uuid`` (so that inductor's caches stay on) from the source of what it runs and the user pass's own."""

    def __init__(self, before=None):
        self.before = before

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        self.run(graph)

    def run(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def source(self) -> str:
        """The text whose hash names this pass (its functions' source)."""
        raise NotImplementedError

    def uuid(self):
        import hashlib
        mine = hashlib.sha256(self.source().encode()).hexdigest()
        before = getattr(self.before, "uuid", lambda: repr(self.before))() if self.before is not None else None
        return (mine, before)


def _sharing() -> bool:
    """Is this compile's graph traced with layers sharing inputs (``mx_compiled=auto``, the default)? Inductor
    runs its custom passes in the compile that traced the graph, under the settings the trace read (and guarded
    on: ``plan``), so the passes, once installed in a process, act on the graphs of ``auto`` only: a later
    ``separate`` compile keeps one quantize call per layer (and counts each layer's inexact blocks), as it would
    in a fresh process."""
    return settings.current().shares_inputs()


class SharePass(_ChainedPass):
    """``share_inputs`` as inductor's pre-grad custom pass, chained after the pass a user set; a no-op in a compile
    that does not share inputs (``_sharing``)."""

    def run(self, graph: torch.fx.Graph) -> None:
        if _sharing():
            share_inputs(graph)

    def uuid(self):   # (what it does depends on the setting: inductor's caches key on it)
        return (super().uuid(), _sharing())

    def source(self) -> str:
        import inspect
        return inspect.getsource(share_inputs) + inspect.getsource(_freeze) + inspect.getsource(_sharing)


# The user kernels whose launches on the same inputs ``share_carriers`` merges in the joint graph: X's carrier rebuilt
# from its kept FP4 codes (``q_expand``), which each consumer's backward asks for.
_SHARED_KERNELS = ("_expand_kernel",)
_FRESH = ("empty.memory_format", "empty_strided.default")


def _fresh(node) -> bool:
    """Is ``node`` a new allocation (``aten.empty``, ``aten.empty_strided``): a launch's output buffer?"""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and any(str(node.target).endswith(f) for f in _FRESH) and str(node.target).startswith("aten."))


def share_carriers(graph: torch.fx.Graph) -> int:
    """Merge the launches of ``_SHARED_KERNELS`` that read the same tensors with the same arguments in the joint
    (forward and backward) graph aot_autograd traced: with ``mx_compiled=auto`` the layers reading one input (q/k/v,
    gate/up) keep one copy of its Wgrad operand as FP4 codes (``share_inputs``), and each layer's backward rebuilds
    its FP8 carrier from those codes (``q_expand``, a launch of ``expand._expand_kernel`` by then); the launches are
    identical but for their fresh output buffers and the inexact-block counter they add to, and the compiler merges
    no user-kernel launches. Here the first one's carrier and group scales serve every later one, whose launch, output
    buffers and count are dropped (the carrier's inexact blocks are counted once, as the shared codes' quantize is).
    The carrier (1.03 bytes an element of X) then lives from the first consumer's Wgrad GEMM to the last one's, which
    in a backward pass follow one another (only dY's operands and the other layers' W operands are made between).
    Inductor's joint custom pre-pass (``ShareCarrierPass``). Returns the number of launches removed."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    import operator
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    seen: dict = {}
    made: dict = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        if getattr(getattr(kernel, "fn", None), "__name__", None) not in _SHARED_KERNELS:
            continue
        kw, clone = node.kwargs["kwargs"], tuple(node.kwargs["tensors_to_clone"])
        outs = tuple(n for n in clone if _fresh(kw[n]))          # (its output buffers)
        chained = tuple(n for n in clone if n not in outs)       # (the counter it adds to)
        if not outs or any(not isinstance(kw[n], torch.fx.Node) for n in chained):
            continue
        consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
        # (the kernel by its function: the side table may hold a wrapper of its own per launch)
        key = (id(kernel.fn), _freeze(node.kwargs["grid"]), _freeze(node.kwargs.get("tma_descriptor_metadata", {})),
               _freeze(consts), outs, chained,
               tuple(sorted((n, _freeze(v)) for n, v in kw.items() if n not in clone)),
               tuple((n, kw[n].target, _freeze(kw[n].args), _freeze(kw[n].kwargs)) for n in outs))
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        users = list(node.users)
        if any(u.op != "call_function" or u.target is not operator.getitem for u in users):
            continue
        for u in users:
            name = u.args[1]
            if name in chained:     # the count this launch would have added: dropped
                u.replace_all_uses_with(kw[name])
            else:                   # the first launch's output, through a getitem placed right after it
                same = made.get((first, name))
                if same is None:
                    with graph.inserting_after(first):
                        same = made[(first, name)] = graph.call_function(operator.getitem, (first, name))
                    same.meta = dict(u.meta)
                u.replace_all_uses_with(same)
            graph.erase_node(u)
        graph.erase_node(node)
        for n in outs:
            if not kw[n].users:
                graph.erase_node(kw[n])
        removed += 1
    return removed


# What X may be made of for ``recompute_wgrad_inputs`` to have it recomputed in the backward: views and casts
# (walked through) and elementwise operations (``torch.Tag.pointwise``), from the nearest tensors made otherwise.
_VIEWS = ("view.default", "_unsafe_view.default", "reshape.default", "permute.default", "t.default",
          "alias.default", "expand.default", "squeeze.dim", "unsqueeze.default", "clone.default",
          "convert_element_type.default", "_to_copy.default")
_RECOMPUTE_DEPTH = 24


def _recomputing() -> bool:
    """Does this compile recompute X for its backward quantize (``wgrad_x_recompute``)? Read as ``_sharing`` is. Warns
    (once) where the setting cannot act: X's Wgrad operand is quantized in the backward only with ``wgrad_x=backward``
    (``auto`` never chooses it)."""
    s = settings.current()
    if s.wgrad_x_recompute and s.wgrad_x != "backward" and not _WARNED_RECOMPUTE:
        import warnings
        _WARNED_RECOMPUTE.append(True)
        warnings.warn(f"mxtrain: wgrad_x_recompute has no effect with wgrad_x={s.wgrad_x}: X is recomputed only "
                      "for a Wgrad operand quantized in the backward; set MXTRAIN_WGRAD_X=backward too", UserWarning,
                      stacklevel=2)
    return s.wgrad_x_recompute


_WARNED_RECOMPUTE: list = []


def recompute_wgrad_inputs(graph: torch.fx.Graph) -> int:
    """In the joint graph, mark for recomputation in the backward the inputs X of the layers whose Wgrad operand is
    quantized in the backward (``wgrad_x=backward``: a single-pass quantize launch there reads X, which the forward
    made), where the forward makes X from elementwise operations only (through views and casts): a norm's output,
    a SwiGLU product. The marks are the ones selective activation checkpointing sets
    (``CheckpointPolicy.MUST_RECOMPUTE`` in ``node.meta["recompute"]``), which the min-cut partitioner honours: X
    and its elementwise producers are not kept but made again in the backward from what is kept anyway (the
    norm's input and statistics, the gate and up projections' outputs), as the compiler does for torchao's traced
    float8 casts. X made otherwise (an attention output, a GEMM's output: kept by their own backward anyway) is
    left to the partitioner. The values are the same: the elementwise operations are recomputed as they ran.
    Returns the number of nodes marked. Inductor's joint custom pre-pass (``ShareCarrierPass``)."""
    import operator
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.utils.checkpoint import CheckpointPolicy
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    backward: set = set()   # (nodes that depend on a tangent)
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)

    def view(n):   # ("aten.view.default" -> ("aten", "view.default"))
        ns, _, name = str(n.target).partition(".")
        return n.op == "call_function" and ns in ("aten", "prims") and name in _VIEWS

    def pointwise(n):
        return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and torch.Tag.pointwise in n.target.tags and not n.target.is_view)

    def feeds_backward(n, depth=6) -> bool:   # (through getitems and views, a user that depends on a tangent)
        todo, seen = [(u, 1) for u in n.users], set()
        while todo:
            u, d = todo.pop()
            if u in backward:
                return True
            if u not in seen and d < depth and (u.target is operator.getitem or view(u)):
                seen.add(u)
                todo.extend((v, d + 1) for v in u.users)
        return False

    marked = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hop or node in backward:
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        if getattr(getattr(kernel, "fn", None), "__name__", None) != "_mxfp4_kernel" or not feeds_backward(node):
            continue
        kw = node.kwargs["kwargs"]
        x = kw.get("x_ptr")
        if not isinstance(x, torch.fx.Node) or x.op != "call_function":
            continue   # (a weight's Dgrad operand reads a parameter)
        chain, todo, ok = [], [x], False
        while todo and len(chain) < _RECOMPUTE_DEPTH:
            n = todo.pop()
            if n in chain or n.op != "call_function" or n in backward:
                continue
            if view(n):
                chain.append(n)
                todo.extend(n.all_input_nodes[:1])
            elif pointwise(n):
                chain.append(n)
                ok = True
                todo.extend(a for a in n.all_input_nodes if a.meta.get("val") is not None
                            and getattr(a.meta["val"], "numel", lambda: 0)() == n.meta["val"].numel())
        if not ok:   # (X not made by an elementwise operation: left to the partitioner)
            continue
        # the launch itself, its fresh output buffers and its outputs as far as the backward's consumers
        chain += [node] + [v for v in kw.values() if _fresh(v)]
        todo = list(node.users)
        while todo:
            u = todo.pop()
            if u not in backward and u not in chain and (u.target is operator.getitem or view(u)):
                chain.append(u)
                todo.extend(u.users)
        for n in chain:
            if n.meta.get("recompute") is None:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                marked += 1
    return marked


# The arguments of ``_mxfp4_kernel`` that are each pass's own in a group launch (``_mxfp4_group_kernel``'s slots),
# and the output names of a functional launch of it
_MEMBER_INTS = ("R", "K", "Rc", "sx_r", "sx_k", "si_r", "si_k", "Kc", "Kq", "gs_sr", "gs_sk")
_MEMBER_ARGS = ("x_ptr", "car_ptr", "gs_ptr", "signs_ptr", "fp4_ptr", "sc_ptr", "cnt_ptr", "key_ptr",
                *_MEMBER_INTS)
_SLOT_INTS = ("R", "K", "Rc", "sxr", "sxk", "sir", "sik", "Kc", "Kq", "gsr", "gsk")


def _grouping() -> bool:
    """Does this compile group weight passes (``w_group``)? Read as ``_sharing`` is (``plan`` passes it to dynamo's
    guards)."""
    return settings.current().w_group == "on"


def _group_member(node, hop) -> tuple | None:
    """``(key, counter in, counter out)`` of a functional launch of ``_mxfp4_kernel`` that may join a group launch
    (``group_weight_launches``): an FP8-carrier pass of a graph input (a weight) without signs, key or packed
    outputs (those slots hold the counter), into fresh buffers of static shape, with static integers; else None.
    ``key``: everything a group's passes must share (the variant, the floats, the input's dtype)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    import operator
    if node.op != "call_function" or node.target is not hop:
        return None
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    if getattr(getattr(kernel, "fn", None), "__name__", None) != "_mxfp4_kernel":
        return None
    kw = node.kwargs["kwargs"]
    if any(v is not None for v in kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]).values()):
        return None   # (its constant arguments: pid_r and pid_k, None (the program ids), and nothing else)
    grid = node.kwargs["grid"]
    cnt = kw.get("cnt_ptr")
    if (len(grid) != 1 or len(grid[0]) != 3 or grid[0][2] != 1 or not all(isinstance(v, int) for v in grid[0])
            or not kw.get("WRITE_CARRIER") or kw.get("WRITE_FP4") or not isinstance(cnt, torch.fx.Node)
            or any(kw.get(n) is not cnt for n in ("signs_ptr", "fp4_ptr", "sc_ptr", "key_ptr"))
            or not isinstance(kw.get("x_ptr"), torch.fx.Node) or kw["x_ptr"].op != "placeholder"
            or sorted(node.kwargs["tensors_to_clone"]) != ["car_ptr", "cnt_ptr", "gs_ptr"]
            or node.kwargs.get("tma_descriptor_metadata")
            or any(isinstance(kw.get(n), torch.fx.Node) for n in _MEMBER_INTS)):
        return None
    for n in ("car_ptr", "gs_ptr"):
        buf = kw[n]
        if not _fresh(buf) or buf.all_input_nodes or len(buf.users) != 1:
            return None
    users = list(node.users)
    if any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in ("car_ptr", "gs_ptr",
                                                                                           "cnt_ptr") for u in users):
        return None
    outs = [u for u in users if u.args[1] == "cnt_ptr"]
    if len(outs) != 1:
        return None
    val = kw["x_ptr"].meta.get("val")
    key = (tuple(sorted((n, _freeze(v)) for n, v in kw.items() if n not in _MEMBER_ARGS)),
           getattr(val, "dtype", None), getattr(val, "device", None))
    return key, cnt, outs[0]


def group_weight_launches(graph: torch.fx.Graph) -> int:
    """Merge runs of up to ``launch.GROUP_MAX`` functional launches of ``_mxfp4_kernel`` that quantize graph inputs
    (the weights) the same way, one after another along one inexact-block counter, into one launch of
    ``_mxfp4_group_kernel`` each (setting ``w_group``): a weight's pass is a small grid that leaves most of a GPU idle,
    and the compiler merges no user-kernel launches. The group launch takes each pass's input, output buffers and
    integers in a slot of its own and runs each pass's tiles as that pass would (the same bytes, tests/kernels/
    test_group_kernel.py); it is placed where its first pass was (the later passes' output buffers move there), its
    outputs serve the passes' readers, and the counter runs through it once. Inductor's joint custom pre-pass
    (``ShareCarrierPass``), on the joint graph aot_autograd traced: the forward's passes along K chain on the forward's
    weight counter, the backward's along N on its own, so the two never share a launch. Returns the number of
    launches removed."""
    import operator
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    runs, cur, cur_key, cur_out = [], [], None, None
    for node in list(graph.nodes):
        m = _group_member(node, hop)
        if m is None:
            continue
        key, cnt_in, cnt_out = m
        if cur and (key != cur_key or cnt_in is not cur_out or len(cur) == GROUP_MAX):
            runs.append(cur)
            cur = []
        cur.append(node)
        cur_key, cur_out = key, cnt_out
    runs.append(cur)
    kidx = None
    removed = 0
    for run in runs:
        if len(run) < 2:
            continue
        if kidx is None:
            kidx = kernel_side_table.add_kernel(_kernels._mxfp4_group_kernel)
        first, mk0 = run[0], run[0].kwargs["kwargs"]
        cnt_in = mk0["cnt_ptr"]
        kw = {"signs_ptr": cnt_in, "cnt_ptr": cnt_in, "key_ptr": cnt_in, "key": mk0["key"],
              "inv_sqrt": mk0["inv_sqrt"], "prescale": mk0["prescale"]}
        end, vals = 0, {}
        for i in range(GROUP_MAX):
            m = run[i] if i < len(run) else run[0]
            mk = m.kwargs["kwargs"]
            if i < len(run):
                nr, nk, _ = m.kwargs["grid"][0]
                end += nr * nk
                for n in ("car_ptr", "gs_ptr"):
                    if i:
                        first.prepend(mk[n])   # (its output buffers, made before the group launch)
                vals.update({f"car{i}": m.meta["val"]["car_ptr"], f"gs{i}": m.meta["val"]["gs_ptr"]})
                kw.update({f"x{i}": mk["x_ptr"], f"car{i}": mk["car_ptr"], f"gs{i}": mk["gs_ptr"]})
            else:   # (an unused slot: the first pass's integers, the counter for its outputs; never read)
                kw.update({f"x{i}": mk["x_ptr"], f"car{i}": cnt_in, f"gs{i}": cnt_in})
            kw.update({f"{s}{i}": mk[n] for s, n in zip(_SLOT_INTS, _MEMBER_INTS)})
            kw[f"nk{i}"] = m.kwargs["grid"][0][1]
            kw[f"end{i}"] = end
        kw.update(group_consts({n: v for n, v in mk0.items() if n not in _MEMBER_ARGS}, len(run)))
        vals["cnt_ptr"] = run[-1].meta["val"]["cnt_ptr"]
        clone = [f"{o}{i}" for i in range(len(run)) for o in ("car", "gs")] + ["cnt_ptr"]
        with graph.inserting_before(first):
            g = graph.call_function(hop, (), dict(kernel_idx=kidx,
                                                  constant_args_idx=kernel_side_table.add_constant_args({}),
                                                  grid=[(end, 1, 1)], tma_descriptor_metadata={}, kwargs=kw,
                                                  tensors_to_clone=clone))
        g.meta = {k: v for k, v in first.meta.items() if k != "eager_input_vals"}
        g.meta["val"] = vals
        if "eager_input_vals" in first.meta:   # (the inputs' eager values of the group launch, not of its first pass:
            # torch's post-grad decomposition of the launch replays them against its arguments)
            eager = {}
            for m in run:
                mk = m.meta.get("eager_input_vals", ((), {}))[1].get("kwargs", {})
                eager.update({v: mk[n] for n, v in m.kwargs["kwargs"].items()
                              if isinstance(v, torch.fx.Node) and n in mk})
            g.meta["eager_input_vals"] = ((), torch.utils._pytree.tree_map_only(
                torch.fx.Node, lambda v: eager.get(v, v.meta.get("val")), dict(g.kwargs)))
        made: dict = {}
        for i, m in enumerate(run):
            for u in list(m.users):
                name = {"car_ptr": f"car{i}", "gs_ptr": f"gs{i}", "cnt_ptr": "cnt_ptr"}[u.args[1]]
                new = made.get(name)
                if new is None:
                    with graph.inserting_after(g):
                        new = made[name] = graph.call_function(operator.getitem, (g, name))
                    new.meta = dict(u.meta)
                u.replace_all_uses_with(new)
                graph.erase_node(u)
        for m in run:
            graph.erase_node(m)
        removed += len(run) - 1
    return removed


class ShareCarrierPass(_ChainedPass):
    """``share_carriers`` (where the compile shares inputs, ``_sharing``) and ``recompute_wgrad_inputs`` (where it
    recomputes X, ``_recomputing``) as inductor's joint custom pre-pass, chained after the pass a user set."""

    def run(self, graph: torch.fx.Graph) -> None:
        if _sharing():
            share_carriers(graph)
        if _recomputing():
            recompute_wgrad_inputs(graph)
        if _grouping():
            group_weight_launches(graph)

    def uuid(self):
        return (super().uuid(), _sharing(), _recomputing(), _grouping())

    def source(self) -> str:
        import inspect
        return (inspect.getsource(share_carriers) + inspect.getsource(_fresh) + inspect.getsource(_freeze)
                + inspect.getsource(_sharing) + repr(_SHARED_KERNELS) + inspect.getsource(recompute_wgrad_inputs)
                + inspect.getsource(_recomputing) + repr((_VIEWS, _RECOMPUTE_DEPTH))
                + inspect.getsource(group_weight_launches) + inspect.getsource(_group_member)
                + inspect.getsource(_grouping) + repr((_MEMBER_INTS, _MEMBER_ARGS, _SLOT_INTS)))


def install_share_pass() -> bool:
    """Install ``SharePass`` as inductor's pre-grad custom pass and ``ShareCarrierPass`` as its joint custom pre-pass
    (each chaining the one already set), once; False where this torch has no such hooks."""
    try:
        from torch._inductor import config as ic
    except ImportError:  # pragma: no cover
        return False
    if _PassBase is object or not hasattr(ic, "pre_grad_custom_pass"):
        return False
    if not isinstance(ic.pre_grad_custom_pass, SharePass):
        ic.pre_grad_custom_pass = SharePass(ic.pre_grad_custom_pass)
    if hasattr(ic, "joint_custom_pre_pass") and not isinstance(ic.joint_custom_pre_pass, ShareCarrierPass):
        ic.joint_custom_pre_pass = ShareCarrierPass(ic.joint_custom_pre_pass)
    return True
