"""Long rows split over co-resident programs that exchange their partial row sums (``Config(exchange=True)``,
``pallas_norm/split_rows.py``) against the float64 reference: every casting mode and dtype, ragged shares and
row blocks, the fused add, NaN rows; both ways a program gets a row's total (the posted slots, or the partials
recomputed from memory) give the same bits; the torch launch route reads the slots' fill and aliasing. On the
GPU: LLM-sized long rows, bits repeatable and independent of who waited, JAX's bits through torch."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import pallas_config, split_rows
from pallas_norm.pallas_config import Config

from helpers import JAX_DTYPES, KERNEL, ON_GPU, bits, check_jax, jax_inputs, jax_vjp, judge

CPU_CONFIGS = [Config(1, 256, 4, exchange=True, prefetch=True), Config(1, 128, 2, exchange=True, programs=16),
               Config(1, 512, 4, exchange=True, reload_weight=True, programs=12)]
CASES = list(itertools.product(JAX_DTYPES, pn.CASTINGS, (0.0, 1.0)))


def _check(shape, dtype, casting, offset, config, seed=0):
    x, w, dy = jax_inputs(shape, dtype, offset, seed=seed, scale=2.0)
    check_jax(x, w, dy, KERNEL, eps=1e-6, offset=offset, casting=casting, config=config, bwd_config=config)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matrix(case):
    """Each (dtype, casting, offset) once; rows of 1000 columns (4 shares of 256, the last ragged; 8 of 128) or
    3000 (6 shares of 512 in 8 slots); 37 rows over groups that take 4 to 37 of them."""
    dtype, casting, offset = CASES[case]
    config = CPU_CONFIGS[case % len(CPU_CONFIGS)]
    _check((37, 3000 if case % 3 == 2 else 1000), dtype, casting, offset, config, seed=case)


def test_fit_groups_shares():
    """``programs`` becomes a whole number of groups of ``chunks(n)`` programs (at most one group per row block);
    a row one program holds has nothing to exchange."""
    fitted = pallas_config.fit(Config(1, 16384, 16, exchange=True, programs=132), 1024, 262144, backward=True)
    assert (fitted.chunks(262144), fitted.programs) == (16, 128)
    assert pallas_config.fit(Config(1, 8192, 16, exchange=True, programs=264), 3, 262144, backward=False).programs == 96
    assert pallas_config.fit(Config(1, 4096, 16, exchange=True, programs=1), 8, 65536, backward=True).programs == 16
    assert not pallas_config.fit(Config(1, 4096, 8, exchange=True), 8, 4096, backward=False).exchange
    with pytest.raises(ValueError, match="exchange must be a bool"):
        Config(1, 256, 4, exchange=1)
    with pytest.raises(ValueError, match="block_rows=1"):
        Config(2, 256, 4, exchange=True)


def test_fused_add_and_nan_rows():
    """The fused add split over programs: ``h`` (stored by each share's program) is ``r(x + residual)``, ``y`` and
    ``dweight`` are ``rms_norm``'s of ``h`` bit for bit, ``dx = dresidual = r(dx_norm + dh_out)``; a NaN in one row
    stays in that row (its slot carries the NaN to every share of the row, no other row sees it)."""
    config = CPU_CONFIGS[0]
    x, w, dy = jax_inputs((9, 1000), jnp.bfloat16, 0.0, seed=5)
    res = jax_inputs((9, 1000), jnp.bfloat16, 0.0, seed=6)[0]
    (y, h), vjp = jax.vjp(lambda a, b, c: pn.rms_norm_add(a, b, c, impl=KERNEL, config=config, bwd_config=config),
                          x, res, w)
    h_ref = (x.astype(jnp.float32) + res.astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(bits(h), bits(h_ref))
    y_plain, dx_plain, dw_plain = jax_vjp(KERNEL, h_ref, w, dy, config=config, bwd_config=config)
    np.testing.assert_array_equal(bits(y), bits(y_plain))
    dh_out = jax_inputs((9, 1000), jnp.bfloat16, 0.0, seed=7)[0]
    dx, dres, dw = vjp((dy, dh_out))
    np.testing.assert_array_equal(bits(dw), bits(dw_plain))
    want = (dx_plain.astype(jnp.float32) + dh_out.astype(jnp.float32))
    assert float(jnp.max(jnp.abs(dx.astype(jnp.float32) - want))) <= 2 ** -6 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_array_equal(bits(dx), bits(dres))

    x_bad = x.at[4, 600].set(jnp.nan)
    y_bad, dx_bad, _ = jax_vjp(KERNEL, x_bad, w, dy, config=config, bwd_config=config)
    y_ok, dx_ok, _ = jax_vjp(KERNEL, x, w, dy, config=config, bwd_config=config)
    keep = np.array([0, 1, 2, 3, 5, 6, 7, 8])
    np.testing.assert_array_equal(bits(y_bad)[keep], bits(y_ok)[keep])
    np.testing.assert_array_equal(bits(dx_bad)[keep], bits(dx_ok)[keep])
    assert np.all(np.isnan(np.asarray(y_bad[4], np.float32)))


def test_posted_and_recomputed_totals_have_the_same_bits(monkeypatch):
    """The interpreter runs programs one after the other: all but a row group's last program find a row's counter
    short and recompute the other shares' partials from memory; the last reads the posted slots. With nobody ever
    seeing a complete counter (every program recomputes) the bits are the same. The broken variant, a program that
    takes its own share's sum for the row's, is caught by the float64 rule."""
    config = CPU_CONFIGS[0]
    x, w, dy = jax_inputs((11, 1000), jnp.float16, 1.0, seed=9)
    kw = dict(casting="gemma", offset=1.0, config=config, bwd_config=config)
    mixed = jax_vjp(KERNEL, x, w, dy, **kw)
    jax.clear_caches()
    try:
        monkeypatch.setattr(split_rows._Exchange, "_count", lambda self, row: jnp.int32(split_rows.UNPOSTED))
        alone = jax_vjp(KERNEL, x, w, dy, **kw)
        for a, b in zip(mixed, alone):
            np.testing.assert_array_equal(bits(a), bits(b))
        monkeypatch.setattr(split_rows._Exchange, "wait", lambda self, row, ok, alone, own: (
            own(row, ok, self.part), alone))
        jax.clear_caches()
        assert judge(x, w, dy, jax_vjp(KERNEL, x, w, dy, **kw), casting="gemma", offset=1.0)
    finally:
        jax.clear_caches()


def test_launch_route_fills_the_slots_per_call():
    """The torch launch route's reader on the split kernels lowered for an (abstract) H100: the slots are a splat
    constant broadcast to ``(m, slots + 1)`` (the last column: the row's counter), aliased to the kernel's last output; the launcher fills a fresh buffer per
    call and hands it to the kernel as operand and result. A kernel writing into a caller's input is refused."""
    torch = pytest.importorskip("torch")
    from torch_bridge import launch_route

    config = Config(1, 16384, 16, exchange=True, prefetch=True)
    device = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        lowered = launch_route._lower_backward(64, 262144, torch.bfloat16, torch.bfloat16, 0.0, "llama", config)
    program = launch_route.parse_program(lowered.compiler_ir("stablehlo"))
    (slots, shape, dtype, value), = program.fills
    split, reduce = program.calls
    assert (split.name, reduce.name) == ("pallas_norm_bwd_split", "pallas_norm_dweight_reduce")
    assert (shape, dtype, value) == ((64, 17), torch.int32, float(split_rows.UNPOSTED))
    assert split.operands[-1] == slots and split.aliases == ((2, len(split.operands) - 1),)

    class Kernel:  # records each launch's buffers
        launches: list = []

        def bind(self, grid, threads):
            return lambda stream, pointers: self.launches.append(pointers)

    fwd = launch_route.KernelCall("k", "", (1, 1, 1), 1, 1, (0, 2), (3, 4), ((4, 8), (4, 2)),
                                  (torch.float32, torch.int32), aliases=((1, 1),))
    program = launch_route.Program((fwd,), (3,), ((4, 8),), (torch.float32,), fills=((2, (4, 2), torch.int32, -1.0),))
    launcher = launch_route.Launcher(program, [Kernel()], 0)
    x = torch.ones(4, 8)
    launcher(x, stream=0)
    launcher(x, stream=0)
    first, second = Kernel.launches
    assert first[1] == first[3] != second[1] == second[3]  # the filled buffer is the aliased result, fresh per call
    assert first[0] == x.data_ptr() and first[2] != first[1]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m,n,dtype,casting,config", [
    (1024, 262144, jnp.bfloat16, "llama", Config(1, 4096, 16, exchange=True, prefetch=True)),
    (512, 262144, jnp.bfloat16, "gemma", Config(1, 8192, 16, exchange=True, prefetch=True)),
    (256, 131072, jnp.float16, "llama", Config(1, 2048, 4, exchange=True, prefetch=True, programs=264)),
    (300, 100000, jnp.bfloat16, "none", Config(1, 4096, 16, exchange=True, prefetch=True, programs=264)),
    (512, 65536, jnp.float32, "llama", Config(1, 4096, 8, exchange=True, prefetch=True, reload_weight=True))])
def test_gpu_long_rows(m, n, dtype, casting, config):
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, dy = jax_inputs((m, n), dtype, offset, seed=m + n)
    check_jax(x, w, dy, "pallas", offset=offset, casting=casting, config=config, bwd_config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_bits_repeat_whoever_waits(monkeypatch):
    """Five runs give the same bits; so do runs where no program polls (``SPIN_LIMIT`` 0: a program that finds a
    slot unposted at its first look recomputes the missing partials): the total does not depend on who waited.
    The torch launch route gives JAX's bits."""
    config = Config(1, 4096, 16, exchange=True, prefetch=True)
    x, w, dy = jax_inputs((512, 262144), jnp.bfloat16, 0.0, seed=1)
    first = [bits(a) for a in jax_vjp("pallas", x, w, dy, config=config, bwd_config=config)]
    for _ in range(4):
        for a, b in zip(jax_vjp("pallas", x, w, dy, config=config, bwd_config=config), first):
            np.testing.assert_array_equal(bits(a), b)
    jax.clear_caches()
    try:
        monkeypatch.setattr(split_rows, "SPIN_LIMIT", 0)
        eager = dataclasses.replace(config, programs=132)  # the same grid, a new cache key: traced with the new limit
        for a, b in zip(jax_vjp("pallas", x, w, dy, config=eager, bwd_config=eager), first):
            np.testing.assert_array_equal(bits(a), b)
    finally:
        jax.clear_caches()
    torch = pytest.importorskip("torch")
    from torch_bridge import launch_route

    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    dev = tx.device.index
    y, rstd = launch_route.forward_launcher(*tx.shape, tx.dtype, tw.dtype, 1e-6, 0.0, "llama", dev, config)(tx, tw)
    dx, dw = launch_route.backward_launcher(*tx.shape, tx.dtype, tw.dtype, 0.0, "llama", dev, config)(tx, tw, tdy, rstd)
    torch.cuda.synchronize()
    for a, b in zip((y, dx, dw), first):
        np.testing.assert_array_equal(bits(a.cpu()), b)
