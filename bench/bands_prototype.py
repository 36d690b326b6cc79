"""The column-band design of ``pallas_norm/bands.py`` in plain Triton, launched from torch: the prototype behind
``bench/results/bands_prototype_h100.md`` (H100, 2026-11-25, ninth session), kept as the starting point for giving
the Triton reference kernel (``torch_bridge/triton_kernels.py``) the same treatment. Not library code: bf16 and
llama casting only, slots as tagged 64-bit words (row + 1 high, float32 bits low; torch has int64 where JAX needs
x64), ``sync=0`` a no-wait control with wrong sums. Each config is checked against torch float32 math and timed by
CUDA events (each call zeroing its slots). Run on a GPU: ``python -m bench.bands_prototype`` (JSON to ``$OUT``).
"""
import json
import os
import time

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _slots(SLOT, rows, P: tl.constexpr, M):
    ptr = SLOT + rows[:, None] * P + tl.arange(0, P)[None, :]
    return ptr, tl.load(ptr, mask=(rows[:, None] < M) & (rows[:, None] >= 0), other=0, volatile=True)


@triton.jit
def _sums(ptr, v, rows, P: tl.constexpr, M, SYNC: tl.constexpr, SPIN: tl.constexpr, ERR):
    """[ROWS] sums over the P tagged slots (fixed order: tl.sum), waiting until every slot carries its row's tag."""
    live = (rows[:, None] < M) & (rows[:, None] >= 0)
    if SYNC:
        want = (rows[:, None] + 1).to(tl.int64)
        ready = tl.min(tl.min(tl.where(((v >> 32) == want) | ~live, 1, 0), axis=1), axis=0)
        spins = 0
        while (ready == 0) & (spins < SPIN):
            v = tl.load(ptr, mask=live, other=0, volatile=True)
            ready = tl.min(tl.min(tl.where(((v >> 32) == want) | ~live, 1, 0), axis=1), axis=0)
            spins += 1
        if ready == 0:
            tl.atomic_add(ERR, 1)
    vals = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.sum(vals, axis=1)


@triton.jit
def _post(SLOT, rows, P: tl.constexpr, pid, M, val):
    bits = val.to(tl.uint32, bitcast=True).to(tl.uint64)
    tag = (rows + 1).to(tl.uint64) << 32
    tl.store(SLOT + rows * P + pid, (tag | bits).to(tl.int64), mask=rows < M)


@triton.jit
def fwd_lag(X, W, Y, RSTD, SLOT, ERR, M, eps, N: tl.constexpr, P: tl.constexpr, BAND: tl.constexpr,
            ROWS: tl.constexpr, K: tl.constexpr, SYNC: tl.constexpr, SPIN: tl.constexpr, PRE: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BAND + tl.arange(0, BAND)
    w = tl.load(W + cols).to(tl.float32)
    steps = tl.cdiv(M, ROWS)
    r_ = tl.arange(0, ROWS)
    if PRE:
        xa = tl.load(X + r_[:, None] * N + cols[None, :], mask=(r_ < M)[:, None], other=0.0,
                     eviction_policy="evict_last")
    for t in range(0, steps + K):
        ra = t * ROWS + r_
        rb = (t - K) * ROWS + r_
        mb = ((rb < M) & (rb >= 0))[:, None]
        if PRE:
            rn = ra + ROWS
            xn = tl.load(X + rn[:, None] * N + cols[None, :], mask=(rn < M)[:, None], other=0.0,
                         eviction_policy="evict_last")
        else:
            xa = tl.load(X + ra[:, None] * N + cols[None, :], mask=(ra < M)[:, None], other=0.0,
                         eviction_policy="evict_last")
        sptr, sv = _slots(SLOT, rb, P, M)
        xb = tl.load(X + rb[:, None] * N + cols[None, :], mask=mb, other=0.0, eviction_policy="evict_first")
        xa32 = xa.to(tl.float32)
        _post(SLOT, ra, P, pid, M, tl.sum(xa32 * xa32, axis=1))
        tot = _sums(sptr, sv, rb, P, M, SYNC, SPIN, ERR)
        rstd = 1.0 / tl.sqrt_rn(tot / N + eps)
        n = (xb.to(tl.float32) * rstd[:, None]).to(tl.bfloat16).to(tl.float32)
        tl.store(Y + rb[:, None] * N + cols[None, :], (n * w[None, :]).to(tl.bfloat16), mask=mb,
                 eviction_policy="evict_first")
        tl.store(RSTD + rb, rstd, mask=(rb < M) & (rb >= 0) & (pid == 0))
        if PRE:
            xa = xn


@triton.jit
def bwd_lag(X, W, DY, RSTD, DX, DW, SLOT, ERR, M, N: tl.constexpr, P: tl.constexpr, BAND: tl.constexpr,
            ROWS: tl.constexpr, K: tl.constexpr, SYNC: tl.constexpr, SPIN: tl.constexpr, PRE: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BAND + tl.arange(0, BAND)
    w = tl.load(W + cols).to(tl.float32)
    dw = tl.zeros([BAND], tl.float32)
    steps = tl.cdiv(M, ROWS)
    r_ = tl.arange(0, ROWS)
    if PRE:
        off0 = r_[:, None] * N + cols[None, :]
        xa = tl.load(X + off0, mask=(r_ < M)[:, None], other=0.0, eviction_policy="evict_last")
        dya = tl.load(DY + off0, mask=(r_ < M)[:, None], other=0.0, eviction_policy="evict_last")
    for t in range(0, steps + K):
        ra = t * ROWS + r_
        rb = (t - K) * ROWS + r_
        mb = ((rb < M) & (rb >= 0))[:, None]
        if PRE:
            rn = ra + ROWS
            offn = rn[:, None] * N + cols[None, :]
            xn = tl.load(X + offn, mask=(rn < M)[:, None], other=0.0, eviction_policy="evict_last")
            dyn = tl.load(DY + offn, mask=(rn < M)[:, None], other=0.0, eviction_policy="evict_last")
        else:
            offa = ra[:, None] * N + cols[None, :]
            xa = tl.load(X + offa, mask=(ra < M)[:, None], other=0.0, eviction_policy="evict_last")
            dya = tl.load(DY + offa, mask=(ra < M)[:, None], other=0.0, eviction_policy="evict_last")
        sptr, sv = _slots(SLOT, rb, P, M)
        offb = rb[:, None] * N + cols[None, :]
        xb = tl.load(X + offb, mask=mb, other=0.0, eviction_policy="evict_first")
        dyb = tl.load(DY + offb, mask=mb, other=0.0, eviction_policy="evict_first")
        rstd = tl.load(RSTD + rb, mask=(rb < M) & (rb >= 0), other=0.0)
        ga = (dya.to(tl.float32) * w[None, :]).to(tl.bfloat16).to(tl.float32)
        _post(SLOT, ra, P, pid, M, tl.sum(ga * xa.to(tl.float32), axis=1))
        c = _sums(sptr, sv, rb, P, M, SYNC, SPIN, ERR)
        x32 = xb.to(tl.float32)
        dy32 = dyb.to(tl.float32)
        g = (dy32 * w[None, :]).to(tl.bfloat16).to(tl.float32)
        n = (x32 * rstd[:, None]).to(tl.bfloat16).to(tl.float32)
        dw += tl.sum(dy32 * n, axis=0)
        dx = rstd[:, None] * (g - x32 * (rstd * rstd * (c / N))[:, None])
        tl.store(DX + offb, dx.to(tl.bfloat16), mask=mb, eviction_policy="evict_first")
        if PRE:
            xa = xn
            dya = dyn
    tl.store(DW + cols, dw)


def ref(x, w, dy, eps):
    x32, w32, dy32 = x.float(), w.float(), dy.float()
    rstd = torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)
    n = (x32 * rstd).bfloat16().float()
    y = (n * w32).bfloat16()
    g = (dy32 * w32).bfloat16().float()
    c = (g * x32).sum(-1, keepdim=True)
    dx = (rstd * (g - x32 * rstd * rstd * c / x.shape[1])).bfloat16()
    dw = (dy32 * n).sum(0)
    return y, rstd[:, 0], dx, dw


def bench(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    eps = 1e-6
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e12
    print(f"copy {copy:.2f} TB/s", flush=True)
    res = {"copy": copy, "rows": []}
    shapes = [(1024, 262144), (2048, 131072), (4096, 65536)]
    for m, n in shapes:
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device=dev)).bfloat16()
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        y_r, rstd_r, dx_r, dw_r = ref(x, w, dy, eps)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        nbytes = m * n * 2
        grid_sets = [(b, r, k, wp, 1, pre) for b in (512, 1024, 2048) for r in (2, 4, 8) for k in (2,)
                     for wp in (4, 8) for pre in (0, 1)]
        grid_sets += [(1024, 4, 1, 8, 1, 1), (1024, 4, 4, 8, 1, 1), (1024, 4, 2, 8, 0, 1), (1024, 8, 2, 8, 0, 1)]
        if m != 1024:
            grid_sets = [g for g in grid_sets if g[0] in (512, 1024) and g[1] >= 4 and g[4] == 1]
        for band, rows, k, warps, sync, pre in grid_sets:
            p = n // band
            if rows * p < 32 * warps:
                continue
            slot = torch.zeros(m * p, dtype=torch.int64, device=dev)
            y = torch.empty_like(x)
            rstd = torch.empty(m, device=dev)
            dx = torch.empty_like(x)
            dw = torch.empty(n, device=dev)
            row = dict(m=m, n=n, band=band, rows=rows, k=k, warps=warps, sync=sync, pre=pre, programs=p)
            try:
                def f():
                    slot.zero_()
                    fwd_lag[(p,)](x, w, y, rstd, slot, err, m, eps, N=n, P=p, BAND=band, ROWS=rows, K=k,
                                  SYNC=sync, SPIN=1 << 12, PRE=pre, num_warps=warps)

                def b():
                    slot.zero_()
                    bwd_lag[(p,)](x, w, dy, rstd_r, dx, dw, slot, err, m, N=n, P=p, BAND=band, ROWS=rows, K=k,
                                  SYNC=sync, SPIN=1 << 12, PRE=pre, num_warps=warps)
                err.zero_()
                f()
                b()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                f()
                b()
                torch.cuda.synchronize()
                if sync and (err.item() or time.perf_counter() - t0 > 0.05):
                    row["fail"] = f"slow or spun out: {time.perf_counter() - t0:.3f} s, err {err.item()}"
                    print(json.dumps(row), flush=True)
                    res["rows"].append(row)
                    continue
                tf = bench(f)
                tb = bench(b)
                row.update(fwd=2 * nbytes / tf / 1e12, bwd=3 * nbytes / tb / 1e12, err=int(err.item()))
                if sync:
                    f()
                    b()
                    torch.cuda.synchronize()
                    row.update(y_ok=bool(torch.equal(y, y_r) or (y.float() - y_r.float()).abs().max().item() < 0.07),
                               y_maxerr=(y.float() - y_r.float()).abs().max().item(),
                               rstd_rel=((rstd - rstd_r).abs() / rstd_r).max().item(),
                               dx_maxerr=(dx.float() - dx_r.float()).abs().max().item(),
                               dw_rel=((dw - dw_r).abs().max() / dw_r.abs().max()).item())
            except Exception as exc:  # noqa: BLE001
                row["fail"] = repr(exc)[:300]
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
        del x, dy, y_r, dx_r
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "bands_prototype.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
