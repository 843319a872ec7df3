"""The ops computing each element from the same elements of their inputs, broadcast as NumPy
broadcasts them (`tf.exp`, `a * b`, a comparison, a cast): which they are (`BROADCAST`), and which
axes of their output hold the rows of a layer call (`aligned`): those of their inputs, aligned from
the last axis. `other_ops` lets them be, but where they pair the rows with values that are not
rows, entry by entry."""

from __future__ import annotations

__all__ = ["BROADCAST", "aligned"]

_NAMES = """Abs Acos Acosh Add AddN AddV2 Angle ApproximateEqual Asin Asinh Atan Atan2 Atanh
    BesselI0e BesselI1e Betainc BiasAdd BitwiseAnd BitwiseOr BitwiseXor Bucketize Ceil ClipByValue
    Complex ComplexAbs Conj Cos Cosh Digamma Div DivNoNan Elu Equal Erf Erfc Erfinv Exp Expm1 Floor
    FloorDiv FloorMod Greater GreaterEqual Igamma Igammac Imag Inv Invert IsFinite IsInf IsNan
    LeakyRelu LeftShift Less LessEqual Lgamma Log Log1p LogicalAnd LogicalNot LogicalOr Maximum
    Minimum Mod Mul MulNoNan Ndtri Neg NextAfter NotEqual Polygamma Pow Real RealDiv Reciprocal Relu
    Relu6 RightShift Rint Round Rsqrt SelectV2 Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt
    Square SquaredDifference Sub Tan Tanh TruncateDiv TruncateMod Xdivy Xlog1py Xlogy Zeta Cast
    ZerosLike OnesLike BroadcastTo LookupTableFindV2 StringToHashBucketFast"""
BROADCAST = frozenset(_NAMES.split())


def aligned(rank: int, inputs, held: list) -> frozenset:
    """The axes of such an op's output (of `rank` axes) that hold the rows: each input's axes
    that hold them (`held`, by input), aligned from the last axis."""
    return frozenset(
        axis + rank - tensor.shape.rank
        for tensor, axes in zip(inputs, held)
        if axes and tensor.shape.rank is not None
        for axis in axes
    )
