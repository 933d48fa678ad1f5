"""The coefficients of ``flash_kernels.activations._normal_tail``: a degree-8 polynomial P with
2^P(a) ~ Phi(-a), the standard normal's lower tail, for a in [0, 9].

Fitted to log2 Phi(-a) in absolute error, which is the relative error of 2^P, by Lawson's iteratively
reweighted least squares (it converges to the minimax fit), then checked as the kernels evaluate it: Horner
in float32 with one rounding per fused multiply-add. Needs only numpy (CPU):

    python scripts/fit_gelu_tail.py
"""

import math

import numpy as np

FIT_END = 9.0  # Phi(-9) = 1.1e-19: the GELU there is -1e-18, and the fit still holds to about 13 (see below)
DEGREE = 8


def log2_tail(a: np.ndarray) -> np.ndarray:
    """log2 Phi(-a) in float64 (erfc keeps its relative precision far past a = 13)."""
    return np.log2(np.array([0.5 * math.erfc(v / math.sqrt(2.0)) for v in a]))


def fit(end: float, degree: int, rounds: int = 300) -> tuple[np.ndarray, float]:
    a = np.linspace(0.0, end, 20_001)
    target = log2_tail(a)
    basis = np.vander(a / end, degree + 1, increasing=True)  # scaled for conditioning
    weight = np.ones_like(a)
    best = (None, math.inf)
    for _ in range(rounds):
        root = np.sqrt(weight)
        coef, *_ = np.linalg.lstsq(basis * root[:, None], target * root, rcond=None)
        err = np.abs(basis @ coef - target)
        if err.max() < best[1]:
            best = (coef, err.max())
        weight = weight * (err + 1e-300)
        weight /= weight.sum()
    return best[0] / end ** np.arange(degree + 1), best[1]


def horner_float32(coef: np.ndarray, a: np.ndarray) -> np.ndarray:
    """P(a) as the kernels compute it: float32 coefficients, an exact product and sum rounded once per step."""
    c32 = coef.astype(np.float32).astype(np.float64)
    a = a.astype(np.float32).astype(np.float64)
    p = np.full_like(a, c32[-1])
    for c in c32[-2::-1]:
        p = (p * a + c).astype(np.float32).astype(np.float64)
    return p


def main():
    coef, err = fit(FIT_END, DEGREE)
    a = np.linspace(0.0, 13.0, 130_001)
    rel = np.abs(np.exp2(horner_float32(coef, a) - log2_tail(a)) - 1.0)
    print(f"degree {DEGREE} on [0, {FIT_END}]: fit error {err * math.log(2):.2e} relative (float64)")
    for lo, hi in ((0, 4), (4, 9), (9, 11), (11, 13)):
        inside = (a >= lo) & (a <= hi)
        print(f"  float32 Horner, a in [{lo}, {hi}]: max relative error of Phi(-a) {rel[inside].max():.2e}")
    print("coefficients, highest degree first (as the kernel's Horner chain takes them):")
    for c in coef[::-1]:
        print(f"  {float(np.float32(c))!r}")


if __name__ == "__main__":
    main()
