"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from engine.backends import native


@pytest.fixture(
    scope="session",
    params=[
        ("KQ_NO_AVX512",),
        ("KQ_NO_AVX512", "KQ_NO_AVXVNNI"),
        ("KQ_NO_AVX512", "KQ_NO_AVXVNNI", "KQ_NO_I16ACC", "KQ_ROWS=2"),
    ],
    ids=["avx2", "avx2-no-vnni", "avx2-widen-each-product-2-rows"],
)
def avx2_kernels(request):
    """The compiled extension built with its AVX2 path (``KQ_NO_AVX512``: what a CPU without AVX-512 VNNI
    compiles; with ``KQ_NO_AVXVNNI`` also without AVX-VNNI, the integer dot products by vpmaddubsw; with
    ``KQ_NO_I16ACC`` and ``KQ_ROWS=2`` every product widened to int32 and 2 rows a pass, as before the int16
    sums), cached next to the default build; skips where the kernels or the AVX2 path cannot be built."""
    if not native.available():
        pytest.skip("the compiled kernels cannot be built here")
    ops = native.variant(*request.param)
    if not ops.isa().startswith("avx2"):
        pytest.skip(f"this CPU has no AVX2 path (built: {ops.isa()})")
    if "KQ_NO_AVXVNNI" in request.param:
        assert ops.isa() == "avx2"  # the flag reaches the source
    return ops


@pytest.fixture(scope="session")
def portable_kernels():
    """The compiled extension built with its portable path (``KQ_NO_SIMD``: what a CPU without AVX2 compiles),
    cached next to the default build; skips where the kernels cannot be built."""
    if not native.available():
        pytest.skip("the compiled kernels cannot be built here")
    return native.variant("KQ_NO_SIMD")
