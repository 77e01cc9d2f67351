"""How close is close: each value of the towers against one device's noise.

A value of the towers' run (each loss at each update step, each gradient of
the first update, each global variable after the last: weights, slots,
batch-norm statistics, the global step) is compared with one device's on
the same batch. Its largest elementwise difference must be at most::

    max(NOISE_FACTOR * noise, ROUNDING * eps * max(1, |one device's|))

where `noise` is how far one device's own value moves when the batch's rows
are permuted (the order of its sums changes, nothing else) and `eps` is the
machine epsilon of the narrowest float dtype the loss is computed in (the
precision every value has at best). Towers add in another order too, so
that noise is the yardstick: tiny for SGD, large where an optimizer such as
Adam turns a gradient that is zero up to rounding into a full step. The
floor covers values whose sums no permutation reorders. Integers and bools
must be equal; a replicated copy must be bitwise copy 0.
"""

import math
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from towers import _losses

NOISE_FACTOR = 8.0
ROUNDING = 64
# One device's permuted runs by default: one alone can reorder a sum whose
# value is pure rounding too little to show the noise Adam makes of it.
PERMUTATIONS = 3
# The failed rows a message shows.
SHOWN = 10


class Row(NamedTuple):
  """One compared value.

  what: the loss, ``gradient of <variable>``, a variable's name, or ``copy
    <name>`` (a replicated copy against copy 0).
  case: the towers' mode and split.
  step: the update step (1-based); after the last for variables.
  difference: the largest elementwise difference (inf if missing or of
    another shape).
  tolerance: what it is held to.
  noise: one device's own difference on permuted rows (None for copies).
  """
  what: str
  case: str
  step: str
  difference: float
  tolerance: float
  noise: Optional[float]

  @property
  def failed(self) -> bool:
    return not self.difference <= self.tolerance


class Values(NamedTuple):
  """What one program's run gave, to compare.

  losses: ``[steps]`` of {key: the loss the update step was computed at},
    in the loss's dtype.
  grads: {key: {variable name: the first update's gradient}}.
  variables: {name: value} of the global variables after the last step.
  copies: {copy's name: (copy 0's name, value)} for replicated copies and
    their slots, after the last step; empty for one device.
  """
  losses: List[Dict[_losses.Key, np.ndarray]]
  grads: Dict[_losses.Key, Dict[str, np.ndarray]]
  variables: Dict[str, np.ndarray]
  copies: Dict[str, tuple]


def orders(rows: int, permutations: int,
           seed: int) -> List[Optional[np.ndarray]]:
  """The orders one device runs a batch of `rows` rows in: as it is (None),
  then `permutations` permutations drawn from `seed`."""
  rng = np.random.RandomState(seed)
  return [None] + [rng.permutation(rows) for _ in range(permutations)]


def compare(case: str, want: Values, noisy: Sequence[Values], got: Values,
            eps: float) -> List[Row]:
  """Every value of `got` against `want`, held to `noisy`'s spread and to
  rounding at `eps`."""
  rows = []
  for step, losses in enumerate(want.losses):
    for key, value in losses.items():
      rows.append(_row("loss" + _losses.named(key), case, str(step + 1),
                       value, [n.losses[step][key] for n in noisy],
                       got.losses[step].get(key), eps))
  for key, grads in want.grads.items():
    for name, value in grads.items():
      rows.append(_row("gradient of %s%s" % (name, _of(key)), case, "1",
                       value, [n.grads[key][name] for n in noisy],
                       got.grads.get(key, {}).get(name), eps))
  after = "after %d" % len(want.losses)
  for name, value in want.variables.items():
    rows.append(_row(name, case, after, value,
                     [n.variables[name] for n in noisy],
                     got.variables.get(name), eps))
  for name, (primary, value) in sorted(got.copies.items()):
    first = got.variables[primary]
    same = (value.shape == first.shape and value.dtype == first.dtype and
            value.tobytes() == first.tobytes())
    rows.append(Row("copy " + name, case, after,
                    0.0 if same else _difference(first, value) or math.inf,
                    0.0, None))
  return rows


def table(failed: Sequence[Row]) -> str:
  """The worst of the `failed` rows, a line per value (its worst case),
  under a header."""
  cases: Dict[str, List[Row]] = {}
  for row in sorted(failed, key=lambda r: -_ratio(r)):
    cases.setdefault(row.what, []).append(row)
  worst = [(rows[0], len(rows) - 1) for rows in cases.values()]
  lines = [(r.what, r.case + (" and %d more" % more if more else ""), r.step,
            _number(r.difference), _number(r.tolerance),
            "-" if r.noise is None else _number(r.noise))
           for r, more in worst[:SHOWN]]
  header = ("what", "case", "step", "difference", "tolerance", "noise")
  widths = [max(len(line[i]) for line in [header] + lines)
            for i in range(len(header))]
  text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
          for line in [header] + lines]
  if len(worst) > SHOWN:
    text.append("... and %d more values" % (len(worst) - SHOWN))
  return "\n".join(text)


def _row(what: str, case: str, step: str, want: object,
         noisy: Sequence[object], got: object, rounding: float) -> Row:
  value = np.asarray(want)
  noise = max([_difference(value, np.asarray(n)) for n in noisy] or [0.0])
  if value.dtype.kind in "fc":
    scale = max(1.0, float(np.max(np.abs(value))) if value.size else 0.0)
    rounding = max(rounding, eps(value.dtype))
    tolerance = max(NOISE_FACTOR * noise, ROUNDING * rounding * scale)
  else:
    tolerance = 0.0
  if got is None:
    return Row(what + " (missing on the towers)", case, step, math.inf,
               tolerance, noise)
  return Row(what, case, step, _difference(value, np.asarray(got)),
             tolerance, noise)


def _difference(want: np.ndarray, got: np.ndarray) -> float:
  """The largest elementwise difference; inf for another shape, or NaN or
  infinity in one but not the other."""
  if want.shape != got.shape:
    return math.inf
  if want.dtype.kind not in "fciub" or got.dtype.kind not in "fciub":
    return 0.0 if np.array_equal(want, got) else math.inf
  a, b = want.astype(np.float64), got.astype(np.float64)
  finite = np.isfinite(a)
  if not np.array_equal(finite, np.isfinite(b)):
    return math.inf
  rest_a, rest_b = a[~finite], b[~finite]
  if not np.all((rest_a == rest_b) | (np.isnan(rest_a) & np.isnan(rest_b))):
    return math.inf
  return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))


def eps(dtype: np.dtype) -> float:
  """The machine epsilon of a float dtype."""
  try:
    return float(np.finfo(dtype).eps)
  except ValueError:
    return 2.0 ** -7  # bfloat16, which NumPy does not know


def _ratio(row: Row) -> float:
  if row.tolerance > 0:
    return row.difference / row.tolerance
  return math.inf if row.difference > 0 else 0.0


def _of(key: _losses.Key) -> str:
  return "" if key is _losses.SINGLE else " (loss %r)" % (key,)


def _number(value: float) -> str:
  return "%.2e" % value if math.isfinite(value) else str(value)
