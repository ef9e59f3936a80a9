"""The layouts of the compiled ops' results, shared with csrc/common/stats_math.h and
csrc/common/hist_math.h: the columns of the statistics rows and the bins of the exponent
histograms. Imports nothing of gradfuse.

Statistics rows (``multi_tensor_stats`` and the per-unit / clamp ops): float64 ``[n, 4]`` with
columns ``SUM``, ``SUMSQ``, ``MAXABS``, ``POWSUM`` (sum |x|^p for orders other than 0, 2 and inf;
min |x| for -inf on the per-tensor path), and int64 ``[n, 4]`` with ``NAN``, ``INF``, ``ZERO``,
``NUMEL``. The rows of ``multi_tensor_moments`` hold ``M2``, the sum of squared deviations from
the mean, in the power sum's column.

Exponent histograms: ``NUM_BINS`` = 283 bins per tensor, the same for every dtype; bin
``e + EXPONENT_OFFSET`` counts the elements with ``floor(log2|x|) == e`` (the table of every bin
is in ``gradfuse.numerics.histogram``).
"""
SUM, SUMSQ, MAXABS, POWSUM = range(4)
M2 = POWSUM
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
