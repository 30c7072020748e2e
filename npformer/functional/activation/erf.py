"""The error function for arrays of any backend, accurate to about 1 ulp in float64.

The rational approximations and their coefficients are those of fdlibm's s_erf.c (Sun
Microsystems, 1993; also used by FreeBSD's libm and Go's math.Erf): on each interval of |x| a
ratio of two polynomials approximates erf (small |x|) or log(x erfc(x)) + x^2 (large |x|).
Each branch is written with arithmetic operators and an `exp` callable only, so the same
formulas run on arrays (the fused GELU's reference) and on autograd Tensors (its composite twin).
On a GPU the GELU kernels call CUDA's erf instead (npformer/functional/cuda/activation.cu). On the
CPU, float32 GELU takes Phi from one rational function of erf (ALPHA / BETA below, within 7.5 float32
ulps, 4.5e-7), `normal_cdf_float32`. Array functions take the array module `xp` (numpy or CuPy)
first; the kernel table `erf` made from `erf` here is in this folder's __init__.py.
"""
import math

ERX = 8.45062911510467529297e-01  # erf(1) rounded to 24 bits: erf(x) = ERX + P/Q near 1
EFX = 1.28379167095512586316e-01  # 2/sqrt(pi) - 1: erf(x) ~ x + EFX x for tiny x
# erf on [0, 0.84375]: erf(x) = x + x * PP(x^2) / QQ(x^2)
PP = (1.28379167095512558561e-01, -3.25042107247001499370e-01, -2.84817495755985104766e-02,
      -5.77027029648944159157e-03, -2.37630166566501626084e-05)
QQ = (1.0, 3.97917223959155352819e-01, 6.50222499887672944485e-02, 5.08130628187576562776e-03,
      1.32494738004321644526e-04, -3.96022827877536812320e-06)
# erf on [0.84375, 1.25]: erf(x) = ERX + PA(x-1) / QA(x-1)
PA = (-2.36211856075265944077e-03, 4.14856118683748331666e-01, -3.72207876035701323847e-01,
      3.18346619901161753674e-01, -1.10894694282396677476e-01, 3.54783043256182359371e-02,
      -2.16637559486879084300e-03)
QA = (1.0, 1.06420880400844228286e-01, 5.40397917702171048937e-01, 7.18286544141962662868e-02,
      1.26171219808761642112e-01, 1.36370839120290507362e-02, 1.19844998467991074170e-02)
# erfc on [1.25, 1/0.35]: erfc(x) = exp(-x^2 - 0.5625 + RA(1/x^2) / SA(1/x^2)) / x
RA = (-9.86494403484714822705e-03, -6.93858572707181764372e-01, -1.05586262253232909814e+01,
      -6.23753324503260060396e+01, -1.62396669462573470355e+02, -1.84605092906711035994e+02,
      -8.12874355063065934246e+01, -9.81432934416914548592e+00)
SA = (1.0, 1.96512716674392571292e+01, 1.37657754143519042600e+02, 4.34565877475229228821e+02,
      6.45387271733267880336e+02, 4.29008140027567833386e+02, 1.08635005541779435134e+02,
      6.57024977031928170135e+00, -6.04244152148580987438e-02)
# erfc on [1/0.35, 6]: same form with RB / SB; beyond 6, erf(x) = 1 in float64
RB = (-9.86494292470009928597e-03, -7.99283237680523006574e-01, -1.77579549177547519889e+01,
      -1.60636384855821916062e+02, -6.37566443368389627722e+02, -1.02509513161107724954e+03,
      -4.83519191608651397019e+02)
SB = (1.0, 3.03380607434824582924e+01, 3.25792512996573918826e+02, 1.53672958608443695994e+03,
      3.19985821950859553908e+03, 2.55305040643316442583e+03, 4.74528541206955367215e+02,
      -2.24409524465858183362e+01)

# float32 on the CPU (GELU's Phi, normal_cdf_float32 below): one odd rational function on [-4, 4] (beyond,
# erf = +-1 in float32), the fast erf of Eigen and XLA: erf(x) = x ALPHA(x^2) / BETA(x^2), within 7.5
# float32 ulps (4.5e-7 absolute) of the float64 formulas above, in about a third of their array passes
ALPHA = (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
         -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10)
BETA = (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
        -1.45660718464996e-05)
FLOAT32_BOUND = 4.0

BOUNDS = (0.84375, 1.25, 1 / 0.35, 6.0)
SQRT_2 = math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def horner(coefficients, z):
    """c0 + c1 z + c2 z^2 + ... evaluated with operators only (arrays or Tensors)."""
    result = coefficients[-1]
    for c in coefficients[-2::-1]:
        result = result * z + c
    return result


def erf_small(a):
    """erf(a) for 0 <= a < 0.84375."""
    z = a * a
    return a + a * (horner(PP, z) / horner(QQ, z))


def erf_middle(a):
    """erf(a) for 0.84375 <= a < 1.25."""
    s = a - 1.0
    return ERX + horner(PA, s) / horner(QA, s)


def erf_near(a, exp):
    """erf(a) = 1 - erfc(a) for 1.25 <= a < 1/0.35; `exp` is the backend's exponential."""
    s = 1.0 / (a * a)
    return 1.0 - exp(-a * a - 0.5625 + horner(RA, s) / horner(SA, s)) / a


def erf_far(a, exp):
    """erf(a) = 1 - erfc(a) for 1/0.35 <= a < 6."""
    s = 1.0 / (a * a)
    return 1.0 - exp(-a * a - 0.5625 + horner(RB, s) / horner(SB, s)) / a


def erf(xp, x):
    """Elementwise erf of an array (numpy, cupy or the test device), dtype kept.

    Every interval's formula runs on the whole array (each fed |x| clamped into its interval) and
    `where` picks each entry's: no data-dependent sizes, so nothing waits for the device (and a
    graph capture can capture it). NaN stays NaN.
    """
    flat_x = x.reshape(-1)                                              # 1-D, so 0-d inputs stay arrays
    a = xp.abs(flat_x)
    out = erf_small(xp.minimum(a, BOUNDS[0]))                           # right on [0, 0.84375)
    for lo, hi, formula in ((BOUNDS[0], BOUNDS[1], erf_middle),
                            (BOUNDS[1], BOUNDS[2], lambda t: erf_near(t, xp.exp)),
                            (BOUNDS[2], BOUNDS[3], lambda t: erf_far(t, xp.exp))):
        out = xp.where(a >= lo, formula(xp.clip(a, lo, hi)), out)
    xp.copyto(out, 1.0, where=a >= BOUNDS[3])                          # NaN fails every test: stays NaN
    return xp.copysign(out, flat_x, out=out).reshape(x.shape)


# Phi(h) = 1/2 + 1/2 erf(h / sqrt 2) by erf's float32 rational function x ALPHA(x^2) / BETA(x^2) on x in
# [-FLOAT32_BOUND, FLOAT32_BOUND] (within 4.5e-7 of erf) with its constants folded in,
# for GELU's CPU kernel: with t = h clipped to [-4 sqrt 2, 4 sqrt 2] and z = t^2, erf(t / sqrt 2) =
# (t / sqrt 2) ALPHA(z / 2) / BETA(z / 2), so 1/2 erf(t / sqrt 2) = t NUM(z) / DEN(z) where
# coefficient k of NUM is ALPHA_k / 2^k / (2 sqrt 2) and of DEN is BETA_k / 2^k, both divided by
# DEN's leading one (DEN monic: its first step is z + c, one pass instead of two).
PHI_BOUND = FLOAT32_BOUND * SQRT_2
_DEN_TOP = BETA[-1] / 2 ** (len(BETA) - 1)
PHI_NUM = tuple(a / 2 ** k / (2 * SQRT_2) / _DEN_TOP for k, a in enumerate(ALPHA))
PHI_DEN = tuple(b / 2 ** k / _DEN_TOP for k, b in enumerate(BETA))[:-1] + (1.0,)


def normal_cdf_float32(xp, h, out):
    """Phi(h), the standard normal CDF, of a float32 array h written into `out` (h's shape and
    dtype), in 25 array passes: the rational function's accuracy (erf within 4.5e-7, so Phi within ~2.3e-7)
    in [0, 1]. NaN stays NaN."""
    t = xp.clip(h, -PHI_BOUND, PHI_BOUND)
    z = xp.multiply(t, t)
    xp.multiply(z, PHI_NUM[-1], out=out)                      # NUM(z) by Horner's rule, in place
    for c in PHI_NUM[-2:0:-1]:
        out += c
        out *= z
    out += PHI_NUM[0]
    den = xp.add(z, PHI_DEN[-2])                              # DEN(z), monic
    for c in PHI_DEN[-3::-1]:
        den *= z
        den += c
    out *= t
    out /= den                                                # 1/2 erf(h / sqrt 2)
    xp.clip(out, -0.5, 0.5, out=out)                          # the ratio overshoots 1/2 by an ulp near the bound
    out += 0.5
    return out
