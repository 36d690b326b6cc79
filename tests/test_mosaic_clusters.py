"""Mosaic GPU kernels on clusters of CTAs (``impl="mosaic"``): rows split over a cluster (the row sums exchanged
through distributed shared memory), the CTAs' exit after their peers' reads, and the dweight reduction shared by a
cluster's CTAs; on the GPU, and the reduction's lowering for Hopper on CPU. The interpreter runs no clusters."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import backend, mosaic
from pallas_norm.mosaic_config import MosaicConfig

from helpers import JAX_DTYPES, check_jax, hopper, jax_inputs, jax_vjp, judge



@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize("dtype", JAX_DTYPES)
def test_gpu_clusters(cluster, dtype):
    """Rows split over a cluster (the sum exchanged through distributed shared memory), ragged last blocks."""
    config = MosaicConfig(block_rows=2, stages=2, cluster=cluster, programs_per_sm=2)
    x, w, dy = jax_inputs((515, 8192), dtype, 0.0, seed=cluster)
    check_jax(x, w, dy, "mosaic", config=config, bwd_config=config)


@pytest.mark.gpu
@hopper
def test_gpu_clusters_are_race_free():
    """The exchange of partial sums between a cluster's CTAs, repeated: every run gives the same bits (a missing
    ordering between a slot's store and the peers' reads shows up as runs that differ)."""
    config = MosaicConfig(block_rows=2, stages=2, cluster=2, programs_per_sm=2)
    x, w, dy = jax_inputs((515, 8192), jnp.float16, 0.0, seed=2)
    run = jax.jit(lambda x, w, dy: jax_vjp("mosaic", x, w, dy, config=config, bwd_config=config))
    first = [np.asarray(a) for a in run(x, w, dy)]
    for _ in range(30):
        for a, b in zip(run(x, w, dy), first):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_dweight_reduction_groups():
    """The dweight reduction shares a column block's partial rows among a cluster of 8, 4 or 2 CTAs where that
    divides them into shares of at least ``REDUCE_MIN_SHARE`` rows; one CTA under the interpreter (no clusters) and
    for counts no group size divides."""
    assert [mosaic.reduce_groups(p, False) for p in (264, 132, 66, 32, 19, 16)] == [8, 4, 2, 2, 1, 1]
    assert mosaic.reduce_groups(264, True) == 1


def test_clustered_dweight_reduction_lowers_for_hopper(monkeypatch):
    """At 33000×4096 the backward's 264 partial rows are reduced on clusters of 8 CTAs: the lowering for a Hopper
    target (on CPU) holds the reduction's cluster (its CTAs' places in it); one CTA per column block holds none."""
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    partials = jax.ShapeDtypeStruct((264, 4096), jnp.float32)

    def lowered() -> str:
        return jax.jit(lambda p: mosaic._dweight_reduce(p, jnp.bfloat16, False)).trace(partials).lower(
            lowering_platforms=("cuda",)).as_text()

    text = lowered()
    assert "mosaic_gpu_v2" in text and "cluster_block_id" in text
    monkeypatch.setattr(mosaic, "reduce_groups", lambda parts, interpret: 1)
    assert "cluster_block_id" not in lowered()


@pytest.mark.gpu
@hopper
def test_gpu_clustered_dweight_reduction(monkeypatch):
    """4096×1024's backward sums 264 partial rows (2 CTAs per SM) on clusters of 8 CTAs, each adding a share of 33
    rows before CTA 0 adds the shares through distributed shared memory: dweight within the rule, the same bits over
    repeated launches. Broken variant: CTAs storing their own share's sum with no cluster exchange (every share
    but one lost) fail the same check."""
    from pallas_norm import mosaic_kernels

    x, w, dy = jax_inputs((4096, 1024), jnp.bfloat16, 0.0, seed=21)
    assert mosaic.reduce_groups(2 * backend.num_sms(), False) > 1
    jax.clear_caches()
    check_jax(x, w, dy, "mosaic")
    run = jax.jit(lambda x, w, dy: jax_vjp("mosaic", x, w, dy))
    first = [np.asarray(a) for a in run(x, w, dy)]
    for _ in range(30):
        for a, b in zip(run(x, w, dy), first):
            np.testing.assert_array_equal(np.asarray(a), b)
    real = mosaic_kernels._dweight_reduce_kernel

    def own_share_only(dwp_g, dw_g, *scratch, parts, cols, unroll, groups):
        real(dwp_g, dw_g, parts=parts // groups, cols=cols, unroll=unroll, groups=1)

    monkeypatch.setattr(mosaic, "_dweight_reduce_kernel", own_share_only)
    jax.clear_caches()
    try:
        assert judge(x, w, dy, jax_vjp("mosaic", x, w, dy))
    finally:
        jax.clear_caches()  # no later test may find the broken variant's traces


EXIT_RACE = r"""
import sys, jax, jax.numpy as jnp
import pallas_norm as pn
from pallas_norm import mosaic_kernels
if sys.argv[1] == "broken":
    mosaic_kernels._cluster_exit = lambda plan, cta: None
for (m, n), (cluster, stages, per_sm) in [((8192, 32768), (8, 3, 4)), ((8192, 32768), (4, 2, 4)),
                                           ((4096, 65536), (8, 3, 2))]:
    config = pn.MosaicConfig(stages=stages, cluster=cluster, programs_per_sm=per_sm)
    x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    f = jax.jit(lambda x, w: pn.rms_norm(x, w, impl="mosaic", config=config))
    first = f(x, w)
    for i in range(2000):
        y = f(x, w)
        if i % 500 == 499:
            assert bool((y == first).all())
"""


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["kernel", "broken"])
def test_gpu_cluster_ctas_outlive_peer_reads(variant):
    """A CTA of a cluster exits only after its peers have read its last block's partial sums: distributed shared
    memory of an exited CTA may not be read. Without the exit barrier (the broken variant) these launches failed
    on the H100 ("unspecified launch failure", in 2 of 2 processes for the first config, 1 of 2 for the others,
    which ends the process: hence a subprocess), and the default config of 4096×65536 was one of them."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    run = subprocess.run([sys.executable, "-c", EXIT_RACE, variant], capture_output=True, text=True, env=env,
                         timeout=300)
    if variant == "kernel":
        assert run.returncode == 0, run.stderr[-2000:]
    else:
        assert run.returncode != 0 and "launch failure" in run.stderr, run.stderr[-2000:]
