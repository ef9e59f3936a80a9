"""The layouts of the compiled ops' results, shared with csrc/common/stats_math.h and
csrc/common/hist_math.h: the columns of the statistics rows and the bins of the exponent
histograms. Imports nothing of gradfuse.

Statistics rows (``multi_tensor_stats`` and the per-unit / clamp ops): float64 ``[n, 4]`` with
columns ``SUM``, ``SUMSQ``, ``MAXABS``, ``POWSUM`` (sum |x|^p for orders other than 0, 2 and inf;
min |x| for -inf on the per-tensor path), and int64 ``[n, 4]`` with ``NAN``, ``INF``, ``ZERO``,
``NUMEL``.

Exponent histograms (``NUM_BINS`` = 283 per tensor, the same for every dtype):

====================  =====================================================================
bin                   elements
====================  =====================================================================
0  (``BIN_BELOW``)    finite, non-zero, ``|x| < 2**-149`` (float64 tensors only)
1  (``BIN_ZERO``)     ``+0`` and ``-0``
``e + 151``           ``floor(log2|x|) == e`` for ``e`` in [-149, 127]: bins 2 .. 278 (the
                      exponents of float32 and bfloat16, subnormals included; float16 uses
                      -24 .. 15)
279 (``BIN_ABOVE``)   finite, ``|x| >= 2**128`` (float64 tensors only)
280, 281, 282         ``+inf``, ``-inf``, NaN
====================  =====================================================================
"""
SUM, SUMSQ, MAXABS, POWSUM = range(4)
NAN, INF, ZERO, NUMEL = range(4)

NUM_BINS = 283
BIN_BELOW = 0
BIN_ZERO = 1
MIN_EXPONENT = -149
MAX_EXPONENT = 127
EXPONENT_OFFSET = 151
BIN_ABOVE = 279
BIN_POS_INF = 280
BIN_NEG_INF = 281
BIN_NAN = 282
