"""The layouts of the compiled ops' results: the columns of the statistics rows and the bins of
the exponent histograms. Imports nothing of gradfuse.

Statistics rows (``multi_tensor_stats``, ``multi_tensor_moments`` and the per-unit / clamp ops):
float64 ``[n, len(FLOAT_COLUMNS)]`` and int64 ``[n, len(COUNT_COLUMNS)]``, one row per tensor (or
unit), with the columns of :data:`FLOAT_COLUMNS` and :data:`COUNT_COLUMNS` in order. This table is
the one place Python declares them: the fake kernels, the reference, the distributed reduction,
the AMP unscale, ``GradStats`` and the data reference read it, and the compiled side declares the
same columns once, in ``csrc/common/stats_math.h`` (``build_info()["stats_layout"]``; a test checks
that the two agree). The rows of ``multi_tensor_moments`` hold ``M2``, the sum of squared
deviations from the mean, in the power sum's column.

Exponent histograms: ``NUM_BINS`` = 283 bins per tensor, the same for every dtype; bin
``e + EXPONENT_OFFSET`` counts the elements with ``floor(log2|x|) == e`` (the table of every bin
is in ``gradfuse.numerics.histogram``; the compiled side: ``csrc/common/hist_math.h``).
"""
from __future__ import annotations

from typing import NamedTuple


class Column(NamedTuple):
    """One column of the statistics rows.

    Attributes:
        name: The column's name (the member of ``StatsAcc`` in ``csrc/common/stats_math.h``).
        combine: How the rows of pieces of one tensor (chunks, shards of a DTensor) combine:
            ``"sum"`` or ``"max"`` (NaN wins).
        degree: For float columns, how the column scales when the data is multiplied by ``c``:
            by ``c ** degree``; ``"p"``: by ``c ** norm_type`` (the power sum). None for counts.
        meaning: What the column holds, as the data reference says it.
    """

    name: str
    combine: str
    degree: int | str | None
    meaning: str


FLOAT_COLUMNS: tuple[Column, ...] = (
    Column("sum", "sum", 1, "sum of the elements"),
    Column("sumsq", "sum", 2, "sum of squares"),
    Column("maxabs", "max", 1, "the largest absolute value (NaN when the tensor holds a NaN)"),
    Column("powsum", "sum", "p",
           "the sum of abs(x)^p for norm orders p other than 0, 2 and inf (0 for those); the smallest "
           "absolute value for -inf on the per-tensor path; `multi_tensor_moments`: M2, the sum of "
           "squared deviations from the mean"),
)
COUNT_COLUMNS: tuple[Column, ...] = (
    Column("nan", "sum", None, "NaN elements"),
    Column("inf", "sum", None, "+-Inf elements"),
    Column("zero", "sum", None, "elements equal to zero"),
    Column("numel", "sum", None, "elements"),
)

FLOAT_NAMES = tuple(c.name for c in FLOAT_COLUMNS)
COUNT_NAMES = tuple(c.name for c in COUNT_COLUMNS)
NUM_FLOAT_STATS = len(FLOAT_COLUMNS)
NUM_COUNT_STATS = len(COUNT_COLUMNS)

# Column positions by name, for the code that reads one column.
SUM, SUMSQ, MAXABS, POWSUM = (FLOAT_NAMES.index(n) for n in ("sum", "sumsq", "maxabs", "powsum"))
M2 = POWSUM
NAN, INF, ZERO, NUMEL = (COUNT_NAMES.index(n) for n in ("nan", "inf", "zero", "numel"))

# The float columns that add up across pieces of a tensor, and those that take the maximum.
SUMMED_FLOAT_COLUMNS = tuple(i for i, c in enumerate(FLOAT_COLUMNS) if c.combine == "sum")
MAX_FLOAT_COLUMNS = tuple(i for i, c in enumerate(FLOAT_COLUMNS) if c.combine == "max")

# ---- The optimizer-update rows (``multi_tensor_update_stats``): float64 ``[n, 4]`` and int64
# ``[n, 5]``, one row per parameter, for the update that torch.optim.SGD / Adam / AdamW is about to
# apply, formed from the weight, the gradient and the optimizer's state before the step. The
# compiled side declares the same columns once, in ``csrc/common/update_math.h``
# (``GRADFUSE_UPDATE_FLOAT_STATS`` / ``GRADFUSE_UPDATE_COUNT_STATS``; ``build_info()["update_stats_layout"]``).
UPDATE_FLOAT_COLUMNS = (
    Column("update_sumsq", "sum", 2, "sum of squares of the update u = w_after - w_before"),
    Column("weight_sumsq", "sum", 2, "sum of squares of the weight before the step"),
    Column("moment1_sumsq", "sum", 2,
           "sum of squares of the first moment after the step (Adam's exp_avg, SGD's momentum buffer; "
           "0 for SGD without momentum)"),
    Column("moment2_sumsq", "sum", 2,
           "sum of squares of Adam's bias-corrected root sqrt(v') / sqrt(1 - beta2^t) (v' the second "
           "moment after the step, its running maximum with amsgrad); 0 for SGD"),
)
UPDATE_COUNT_COLUMNS = (
    Column("update_nonfinite", "sum", None, "NaN or Inf elements of the update"),
    Column("weight_nonfinite", "sum", None, "NaN or Inf elements of the weight before the step"),
    Column("moment_nonfinite", "sum", None, "elements whose first or second moment after the step is NaN or Inf"),
    Column("eps_dominated", "sum", None,
           "Adam: elements whose bias-corrected root is below eps (the denominator is mostly eps); 0 for SGD"),
    Column("numel", "sum", None, "elements"),
)

UPDATE_FLOAT_NAMES = tuple(c.name for c in UPDATE_FLOAT_COLUMNS)
UPDATE_COUNT_NAMES = tuple(c.name for c in UPDATE_COUNT_COLUMNS)
NUM_UPDATE_FLOAT_STATS = len(UPDATE_FLOAT_COLUMNS)
NUM_UPDATE_COUNT_STATS = len(UPDATE_COUNT_COLUMNS)
UPDATE_SUMSQ, WEIGHT_SUMSQ, MOMENT1_SUMSQ, MOMENT2_SUMSQ = (
    UPDATE_FLOAT_NAMES.index(n) for n in ("update_sumsq", "weight_sumsq", "moment1_sumsq", "moment2_sumsq"))
UPDATE_NONFINITE, WEIGHT_NONFINITE, MOMENT_NONFINITE, EPS_DOMINATED, UPDATE_NUMEL = (
    UPDATE_COUNT_NAMES.index(n)
    for n in ("update_nonfinite", "weight_nonfinite", "moment_nonfinite", "eps_dominated", "numel"))

# The hyper-parameter table of the update ops: float64 ``[n, len(HYPER_COLUMNS)]``, one row per
# parameter, on the parameters' device. SGD reads ``beta1`` as its momentum and ``beta2`` as its
# dampening; ``step`` is Adam's step number t of the step being taken (the state's step + 1);
# ``flags`` holds the ``FLAG_*`` bits as a float64 integer.
HYPER_COLUMNS = ("lr", "weight_decay", "beta1", "beta2", "eps", "step", "flags")
NUM_HYPER = len(HYPER_COLUMNS)
HYPER_LR, HYPER_WEIGHT_DECAY, HYPER_BETA1, HYPER_BETA2, HYPER_EPS, HYPER_STEP, HYPER_FLAGS = range(NUM_HYPER)
FLAG_MAXIMIZE = 1
FLAG_NESTEROV = 2
FLAG_AMSGRAD = 4
FLAG_DECOUPLED = 8
# The ``rule`` argument of the update ops.
RULE_SGD = 0
RULE_ADAM = 1

# The table of the fused optimizer step (``multi_tensor_optim_step_``): float64
# ``[n, len(STEP_COLUMNS)]``, one row per parameter, on the parameters' device, holding the scalars
# torch's step forms in Python (``csrc/common/step_math.h``, ``StepCoef``); ``flags`` holds the
# ``STEP_*`` bits as a float64 integer.
STEP_COLUMNS = ("weight_decay", "momentum", "damp_alpha", "neg_lr", "lerp_weight", "beta2", "one_minus_beta2",
                "bc2_sqrt", "eps", "neg_step_size", "decay_factor", "flags")
NUM_STEP_COEFS = len(STEP_COLUMNS)
STEP_MAXIMIZE = 1
STEP_NESTEROV = 2
STEP_AMSGRAD = 4
STEP_DECOUPLED = 8
STEP_FIRST = 16  # SGD: no momentum buffer yet

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


def rows_markdown() -> str:
    """The columns of the statistics rows as the Markdown table of the data reference."""
    lines = ["| row | column | position | meaning |", "|---|---|---|---|"]
    for kind, columns in (("float64", FLOAT_COLUMNS), ("int64", COUNT_COLUMNS)):
        lines += [f"| {kind} | `{c.name}` | {i} | {c.meaning} |" for i, c in enumerate(columns)]
    return "\n".join(lines)
