"""The Triton reference's forward and backward on column bands (``triton_config.Config.lag``,
``torch_bridge/triton_bands.py``). On CPU Triton's interpreter runs the programs one after another: every program but
the last computes its peers' partial sums itself (the fallback), the last reads them as posted."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

import torch_bridge
from torch_bridge import triton_band_slots, triton_bands, triton_config, triton_kernels, triton_launch

from helpers import HAS_CUDA, ON_GPU, judge, torch_inputs

CASES = [((37, 4000), triton_config.Config(4, 512, 4, lag=2), torch.bfloat16, "llama", 0.0),
         ((5, 2048), triton_config.Config(2, 128, 4, lag=3), torch.float16, "gemma", 1.0),
         ((9, 1500), triton_config.Config(8, 256, 2, lag=1), torch.float32, "none", 0.0),
         ((37, 4000), triton_config.Config(2, 512, 4, lag=2, groups=3), torch.bfloat16, "gemma", 1.0),
         ((37, 4000), triton_config.Config(4, 512, 4, lag=2, prefetch=True), torch.bfloat16, "llama", 0.0),
         ((37, 4000), triton_config.Config(2, 512, 4, lag=1, groups=3, prefetch=True), torch.float16, "gemma", 1.0)]


def _run(shape, config, dtype, casting, offset, seed=1, **kw):
    x, w, dy = torch_inputs(shape, dtype, offset, seed=seed, scale=2.0)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, offset, casting, config=config)
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=config, **kw)
    return judge(x, w, dy, (y, dx, dw), eps=1e-6, offset=offset, casting=casting)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bands_backward_matches_float64_rule(case):
    assert _run(*CASES[case]) == []


def test_float32_weight_with_bfloat16_rows():
    """dweight is stored in the weight's dtype by each band's owner."""
    x, w, dy = torch_inputs((37, 4000), torch.bfloat16, 1.0, weight_dtype=torch.float32, seed=9, scale=2.0)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 1.0, "gemma")
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 1.0, "gemma", True, True, config=CASES[0][1])
    assert dw.dtype == torch.float32
    assert judge(x, w, dy, (y, dx, dw), eps=1e-6, offset=1.0, casting="gemma") == []


@pytest.mark.skipif(HAS_CUDA, reason="compiled, the broken exchange is a race its peers may win (it went unseen on an "
                    "H200); the interpreter's programs run one after another, so there it is certain")
def test_slots_read_before_they_are_posted_are_caught(monkeypatch):
    """The rule above catches a broken exchange: slots filled with 0 instead of ``UNPOSTED`` look posted at once,
    so a program sums zeros for the peers that have not posted yet (y in the forward, dx in the backward)."""
    monkeypatch.setattr(triton_bands, "UNPOSTED", 0)
    failures = _run(*CASES[0], seed=2)
    assert any(f.startswith("y") for f in failures) and any("dx" in f for f in failures)


def test_row_groups_give_one_groups_bits():
    """Row groups change who walks which rows, not the row sums: y, rstd and dx are one group's bits (dweight: the
    groups' partials summed in group order, held to the rule above)."""
    x, w, dy = torch_inputs((37, 4000), torch.bfloat16, 0.0, seed=13, scale=2.0)
    runs = []
    for groups in (1, 4):
        config = triton_config.Config(2, 512, 4, lag=2, groups=groups)
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=config)
        runs.append((y, rstd, triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, False, config=config)[0]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_prefetch_gives_the_same_bits():
    """Loading block t + 1 before block t's math (``Config.prefetch``) moves loads, not arithmetic: y, rstd, dx and
    dweight, and the fused add's y and h, are the bits without it (row groups and a dweight-only call too)."""
    x, w, dy = torch_inputs((37, 4000), torch.bfloat16, 1.0, seed=14, scale=2.0)
    r = torch_inputs((37, 4000), torch.bfloat16, 0.0, seed=15)[0]
    runs = []
    for prefetch in (False, True):
        config = triton_config.Config(2, 512, 4, lag=2, groups=3, prefetch=prefetch)
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 1.0, "gemma", config=config)
        fused = triton_kernels.rms_norm_fwd(x, w, 1e-6, 1.0, "gemma", config=config, residual=r, h_dtype=x.dtype)
        grads = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 1.0, "gemma", True, True, config=config)
        dw_only = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 1.0, "gemma", False, True, config=config)[1]
        runs.append((y, rstd, *fused[:2], *grads, dw_only))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


FULL_CONFIGS = [triton_config.Config(2, 512, 4, lag=2, prefetch=True),
                triton_config.Config(2, 512, 4, lag=1, groups=4, prefetch=True)]


def _backward_runs(x, w, dy, r, configs=FULL_CONFIGS) -> list[torch.Tensor]:
    """y, rstd, dx and dweight, and the fused add's y, h, rstd, dh and dweight, for each of ``configs``."""
    outs = []
    for config in configs:
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=config)
        y_add, h, rstd_h = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=config, residual=r,
                                                       h_dtype=x.dtype)
        outs += [y, rstd, *triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, config=config),
                 y_add, h, rstd_h,
                 *triton_kernels.rms_norm_bwd(dy, h, w, rstd_h, 0.0, "llama", True, True, config=config, dh_out=r)]
    return outs


def test_full_blocks_walk_gives_the_masked_walks_bits(monkeypatch):
    """Where every row block of every group and every band is full (``triton_bands._full``, the Pallas kernels'
    rule) the plain backward walks in three loops with constant masks (FULL: unmasked loads and stores on a GPU): its
    dx and dweight, one row group and four, are the masked walk's bits. Forced here for the fused add's backward too
    (the kernel takes it; the heuristic does not: ``_full``), whose dh and dweight are the masked walk's bits."""
    x, w, dy = torch_inputs((16, 2048), torch.bfloat16, 0.0, seed=31, scale=2.0)
    r = torch_inputs((16, 2048), torch.bfloat16, 0.0, seed=32)[0]
    assert all(triton_bands._full(16, 2048, c, triton_bands._groups(16, c), c.lag, False) for c in FULL_CONFIGS)
    assert not triton_bands._full(16, 2048, FULL_CONFIGS[0], 1, 2, True)  # not the fused add's
    assert not triton_bands._full(17, 2048, FULL_CONFIGS[0], 1, 2, False)  # a last block of one row
    monkeypatch.setattr(triton_bands, "_full", lambda *args: True)
    full = _backward_runs(x, w, dy, r)
    monkeypatch.setattr(triton_bands, "_full", lambda *args: False)
    monkeypatch.setattr(triton_launch, "_DIRECT", {})  # on a GPU, the launches above are cached by key
    masked = _backward_runs(x, w, dy, r)
    for a, b in zip(full, masked, strict=True):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@triton.jit
def _group_zero_block(t, g, G: tl.constexpr, BLOCK_M: tl.constexpr, M, FULL: tl.constexpr = False):
    """``triton_bands._block`` broken under FULL: every row group walks group 0's rows."""
    rows = (t * G + (0 if FULL else g)) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, tl.full([BLOCK_M], True, tl.int1) if FULL else rows < M


@pytest.mark.skipif(HAS_CUDA, reason="compiled, a kernel binds its jit helpers when first compiled; the interpreter "
                    "looks them up per call, so only there can the test swap one")
def test_full_blocks_walk_broken_variant_is_caught(monkeypatch):
    """The comparison above catches a broken walk of full blocks: its rows of every group group 0's (the other
    groups' rows left unwritten, their sums posted twice)."""
    x, w, dy = torch_inputs((16, 2048), torch.bfloat16, 0.0, seed=31, scale=2.0)
    r = torch_inputs((16, 2048), torch.bfloat16, 0.0, seed=32)[0]
    monkeypatch.setattr(triton_bands, "_full", lambda *args: True)
    full = _backward_runs(x, w, dy, r, FULL_CONFIGS[1:])
    monkeypatch.setattr(triton_bands, "_block", _group_zero_block)
    broken = _backward_runs(x, w, dy, r, FULL_CONFIGS[1:])
    assert not all(torch.equal(a, b) for a, b in zip(full, broken))


def test_g_in_the_row_dtype_keeps_the_float32_products_bits():
    """The band backward's g = r(dy·w_eff) taken as one multiply in the row dtype (LOW, forced here: the heuristic
    takes it for bf16 rms_norm, ``triton_product.grad_in_dtype``) gives the float32 product's bits: dx and dweight,
    plain and fused add, equal with LOW off (fp16 rows on CPU: the interpreter multiplies bf16 by truncation).
    Broken variant: LOW forced for Gemma's casting, whose w_eff = 1 + w is no fp16 value (rounded, g moves): its dx
    differs from the float32 product's."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    x, w, dy = torch_inputs((37, 4000), dtype, 0.0, seed=21, scale=2.0)
    dh = torch_inputs((37, 4000), dtype, 0.0, seed=22)[0]
    config = CASES[4][1]

    def run(low, casting="llama", offset=0.0):
        _, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, offset, casting, config=config)
        key = ("low", low)  # the launch key: LOW is what ``grad_in_dtype`` gives for the key's other fields
        return (*triton_bands.backward(dy, x, w, rstd, offset, casting, True, True, config, key, low=low),
                *triton_bands.backward(dy, x, w, rstd, offset, casting, True, True, config, key, dh_out=dh, low=low))

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    forced, f32 = run(True, "gemma", 1.0)[0], run(False, "gemma", 1.0)[0]
    assert not torch.equal(forced.view(torch.int16), f32.view(torch.int16))


def test_forward_rstd_and_fused_add_on_bands():
    """rstd (stored by band 0's program) is the row's; the fused add's h is the resident path's bits and its y the
    norm of h (the same band sums)."""
    config = CASES[0][1]
    x, w, _ = torch_inputs((37, 4000), torch.bfloat16, 0.0, seed=11, scale=2.0)
    r = torch_inputs((37, 4000), torch.bfloat16, 0.0, seed=12)[0]
    _, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=config)
    x64 = x.double()
    torch.testing.assert_close(rstd.double(), torch.rsqrt((x64 * x64).mean(dim=1) + 1e-6), rtol=2e-6, atol=0)
    y, h, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=config, residual=r, h_dtype=x.dtype)
    _, h_ref, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", residual=r, h_dtype=x.dtype)
    assert torch.equal(h, h_ref)
    assert torch.equal(y, triton_kernels.rms_norm_fwd(h, w, 1e-6, 0.0, "llama", config=config)[0])


def test_float64_and_dweight_only_calls():
    """float64 stays on the chunked path (its partial sums do not fit 32-bit slots); without dx nothing is
    exchanged and dweight is the full call's bits."""
    config = triton_config.Config(4, 512, 4, lag=2)
    assert _run((9, 3000), config, torch.float64, "llama", 0.0) == []
    x, w, dy = torch_inputs((37, 4000), torch.bfloat16, 0.0, seed=3)
    _, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    _, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, config=config)
    dx_none, dw_only = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", False, True, config=config)
    assert dx_none is None and torch.equal(dw_only, dw)


def test_heuristic_takes_bands_for_long_rows():
    """One-warp programs on 1024-column bands of one row, in row groups (8 / 16 programs per SM), while a row has at
    most ``BANDS_MAX_PER_SM`` bands per SM: the backward beyond 8192 columns, the forward for rows longer than the
    32768 it holds in registers, its next block prefetched up to ``FWD_BANDS_PREFETCH_MAX_N`` columns (the
    backward's, plain and fused add, at every length);
    ``BANDS_SPARE`` slots left free (16384 float32 columns: 64 groups of 16 bands in the 8 × 132 slots, not 66)."""
    band = functools.partial(triton_config.Config, 1, 1024, 1, lag=2)
    assert triton_config.backward_config(262144, 132) == band(groups=4, prefetch=True)
    assert triton_config.forward_config(262144, 132) == band(groups=8)
    assert triton_config.backward_config(16384, 132, itemsize=4) == band(groups=64, prefetch=True)  # 16-bit: held
    assert triton_config.backward_config(540672, 132, fused=True).prefetch
    assert triton_config.forward_config(65536, 132) == band(groups=32, prefetch=True)
    assert triton_config.forward_config(131072, 132).prefetch and not triton_config.forward_config(131073, 132).prefetch
    assert not triton_config.forward_config(65536, 132, fused=True).prefetch
    for config in (triton_config.backward_config, triton_config.forward_config):
        assert config(540672, 132).lag and config(262144, 114).lag and config(32769, 132).lag
        assert not config(8192, 132).lag and not config(540673, 132).lag  # 529 bands on 132 SMs: chunked
    assert triton_config.backward_config(8193, 132).lag  # 9 bands, the last of one column
    assert not triton_config.forward_config(32768, 132).chunked(32768)  # held in registers
    with pytest.raises(ValueError, match="lag"):
        triton_config.Config(1, 1024, 4, lag=-1)


@triton.jit
def _slot_sums_kernel(V, OUT, P, S: tl.constexpr, BLOCK_M: tl.constexpr, PAIRWISE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pcols = tl.arange(0, S)
    slot_mask = (rows[:, None] >= 0) & (pcols[None, :] < P)
    vals = tl.load(V + rows[:, None] * S + pcols[None, :])
    if PAIRWISE:
        total = triton_band_slots._sum_slots(vals, slot_mask, BLOCK_M, S)
    else:  # the broken variant: tl.sum, whose order follows the layout Triton gives vals at each call site
        total = tl.sum(tl.where(slot_mask, vals, 0.0), axis=1)
    tl.store(OUT + rows, total)


def test_slot_sums_are_one_fixed_pairwise_tree():
    """The band backward sums a block's slots in two loops, whose slot tiles Triton may lay out differently; the sum
    is the pairwise tree ((s0 + s1) + (s2 + s3)) + ... whatever the layout (with ``tl.sum`` a GPU run gave dx bits
    that depended on which program waited). Slots of 40 binades, padding masked; ``tl.sum`` is caught."""
    m, p, s = 8, 100, 128
    gen = torch.Generator().manual_seed(21)
    vals = torch.randn(m, s, generator=gen) * torch.exp2(torch.randint(-20, 20, (m, s), generator=gen).float())
    vals[:, p:] = float("nan")  # padding: never read into the sum
    tree = torch.where(torch.arange(s) < p, vals, 0.0)
    while tree.shape[1] > 1:
        tree = tree[:, 0::2] + tree[:, 1::2]
    device = "cuda" if ON_GPU else "cpu"
    sums = {}
    for pairwise in (True, False):
        out = torch.empty(m, device=device)
        _slot_sums_kernel[(m // 2,)](vals.to(device), out, p, S=s, BLOCK_M=2, PAIRWISE=pairwise)
        sums[pairwise] = out.cpu()
    assert torch.equal(sums[True], tree[:, 0])
    assert not torch.equal(sums[False], tree[:, 0])


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("shape,dtype,casting,offset", [((300, 300000), torch.float16, "gemma", 1.0),
                                                        ((64, 262144), torch.float32, "llama", 0.0),
                                                        ((256, 16000), torch.bfloat16, "llama", 0.0),
                                                        ((300, 10000), torch.bfloat16, "gemma", 1.0),
                                                        ((100, 40000), torch.float16, "gemma", 1.0),
                                                        ((128, 65536), torch.float32, "none", 0.0)], ids=str)
def test_gpu_bands_match_float64_rule(shape, dtype, casting, offset):
    """The heuristics' configs: bands in both directions, but the forward of rows it holds (up to 32768 columns)."""
    assert triton_config.backward_config(shape[1]).lag
    assert bool(triton_config.forward_config(shape[1]).lag) == (shape[1] > triton_config.FWD_RESIDENT_MAX_N)
    assert _run(shape, None, dtype, casting, offset) == []


@gpu
@pytest.mark.parametrize("config", [triton_config.Config(1, 1024, 4, lag=1, groups=16),
                                    triton_config.Config(2, 2048, 4, lag=2, groups=16)], ids=repr)
def test_gpu_slot_tiles_smaller_than_the_threads_match_float64_rule(config):
    """64 bands of one row (32 of two) on 4 warps in 16 row groups: the slots padded to 4 per thread
    (``pallas_norm.band_slots.slot_width``; replicated slot tiles gave NaN rows in the Pallas kernels on the H100)."""
    assert _run((512, 65536), config, torch.bfloat16, "llama", 0.0, seed=6) == []


@gpu
def test_gpu_bands_bits_do_not_depend_on_who_waited_and_fused_dweight_agrees(monkeypatch):
    """Three launches and one where no program waits (``SPIN_LIMIT = 0``: whoever finds a block incomplete computes
    the missing partials): the same bits. The fused add's backward stores the plain norm's dweight bits."""
    assert ON_GPU
    x, w, dy = torch_inputs((512, 262144), torch.bfloat16, 0.0, seed=4)
    _, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    runs = [triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True) for _ in range(3)]
    monkeypatch.setattr(triton_bands, "SPIN_LIMIT", 0)
    runs.append(triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True))
    for dx, dw in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1])
    r = torch_inputs((512, 262144), torch.bfloat16, 0.0, seed=5)[0]
    wf = w.detach().clone().requires_grad_()
    xf, rf = (t.detach().clone().requires_grad_() for t in (x - r, r))
    y, h = torch_bridge.rms_norm_add(xf, rf, wf, backend="triton")
    torch.autograd.backward([y], [dy])
    _, rstd_h = triton_kernels.rms_norm_fwd(h.detach(), w, 1e-6, 0.0, "llama")
    _, dw_plain = triton_kernels.rms_norm_bwd(dy, h.detach(), w, rstd_h, 0.0, "llama", True, True)
    assert torch.equal(wf.grad, dw_plain)
