"""Tiny non-negative least squares (active set on the normal equations) in plain Python.

The cost model has four coefficients, so a 4x4 solve is all that is needed; this keeps the
core free of numpy on import and deterministic.
"""

from __future__ import annotations


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _lstsq(rows: list[list[float]], ys: list[float], cols: list[int]) -> list[float] | None:
    # scale columns so the normal equations stay well conditioned
    scale = [max(abs(r[c]) for r in rows) or 1.0 for c in cols]
    ata = [
        [sum(r[ci] * r[cj] for r in rows) / (si * sj) for cj, sj in zip(cols, scale)]
        for ci, si in zip(cols, scale)
    ]
    aty = [sum(r[ci] * y for r, y in zip(rows, ys)) / si for ci, si in zip(cols, scale)]
    x = solve(ata, aty)
    return None if x is None else [v / s for v, s in zip(x, scale)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Minimise ||rows @ x - ys|| subject to x >= 0 (drop the most negative column, refit)."""
    ncols = len(rows[0])
    active = list(range(ncols))
    while active:
        x = _lstsq(rows, ys, active)
        if x is None:  # singular: drop the column that carries no information (last first)
            informative = [c for c in active if any(r[c] for r in rows)]
            active = informative if len(informative) < len(active) else active[:-1]
            continue
        worst = min(range(len(active)), key=lambda i: x[i])
        if x[worst] >= 0:
            out = [0.0] * ncols
            for c, v in zip(active, x):
                out[c] = v
            return out
        active.pop(worst)
    raise ValueError("least squares failed: no column explains the samples")
