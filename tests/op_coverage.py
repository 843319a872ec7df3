"""Every public function of `keras.ops` (with its submodules), applied to a tensor holding the rows
of a layer call: the table of tests/test_op_coverage.py.

`OPS` names each function once (`keras.ops.image.resize` as "image.resize"), with how it is applied
to the call's values (`Values`): a function of them, or a dict of such functions by variant (an op
with an axis over the rows, over all axes and over the last axis), or the reason it takes no
tensor to a tensor (`NOT_A_TENSOR_MAP`). `names()` lists the functions of `keras.ops` itself, so a
Keras release that adds one fails the test until this table names it.

The values are kept in the domain of each op (`pos` for a logarithm, `unit` for an arcsine), so
one device computes finite numbers everywhere.
"""

import inspect
from dataclasses import dataclass

import keras
from keras import ops

#: The submodules of `keras.ops` whose functions are not all `keras.ops`' own.
SUBMODULES = ("image", "nn", "numpy", "linalg", "core", "math")


def names() -> list[str]:
    """The public functions of `keras.ops` and its submodules, each once, by name."""
    found = {}
    modules = [("", keras.ops)]
    modules += [(f"{n}.", getattr(keras.ops, n)) for n in SUBMODULES if hasattr(keras.ops, n)]
    for prefix, module in modules:
        for name in sorted(dir(module)):
            value = getattr(module, name)
            if not name.startswith("_") and inspect.isfunction(value):
                found.setdefault(id(value), prefix + name)
    return sorted(found.values())


def function(name: str):
    module, _, short = name.rpartition(".")
    return getattr(getattr(keras.ops, module) if module else keras.ops, short)


@dataclass
class Values:
    """The values of a layer call, computed from its rows `h` (rows, 8), each in an op's domain."""

    h: object

    @property
    def pos(self):  # in (0.5, 2.5)
        return 1.5 + self.h

    @property
    def unit(self):  # in (-0.9, 0.9)
        return 0.9 * self.h

    @property
    def ints(self):  # 0 to 7
        return ops.cast(ops.floor((self.h + 1.0) * 4.0), "int32")

    @property
    def bools(self):
        return self.h > 0

    @property
    def img(self):  # (rows, 2, 2, 2): images, channels last
        return ops.reshape(self.h, (-1, 2, 2, 2))

    @property
    def seq(self):  # (rows, 4, 2): sequences of 4 steps
        return ops.reshape(self.h, (-1, 4, 2))

    @property
    def mat(self):  # (rows, 2, 2, 2): two 2 x 2 matrices per row
        return ops.reshape(self.h, (-1, 2, 2, 2))

    @property
    def spd(self):  # symmetric positive definite
        m = self.mat
        return ops.matmul(m, ops.swapaxes(m, -1, -2)) + 2.0 * ops.eye(2, dtype=m.dtype)

    @property
    def lower(self):  # lower triangular, invertible
        return ops.tril(self.mat) + 2.0 * ops.eye(2, dtype=self.h.dtype)

    @property
    def cplx(self):  # (rows, 4) complex
        return ops.view_as_complex(ops.reshape(self.h, (-1, 4, 2)))

    @property
    def table(self):  # (8, 8): not rows of the batch
        return ops.reshape(ops.cos(ops.arange(64, dtype=self.h.dtype)), (8, 8))


def _axes(apply, axes=(0, None, -1)):
    """`apply(v, axis)` over the rows, over all axes, over the last axis."""
    named = {0: "rows", None: "all", -1: "last"}
    return {named[a]: (lambda v, a=a: apply(v, a)) for a in axes}


def _unary(name: str, domain: str = "h"):
    return lambda v: function(name)(getattr(v, domain))


def _binary(name: str, domain: str = "h", other=lambda v: ops.flip(v.h, axis=1)):
    """With another tensor of rows: each row's own values, reversed (not another row's)."""
    return lambda v: function(name)(getattr(v, domain), other(v) + 0.0 * getattr(v, domain))


def _reduction(name: str, domain: str = "h", **kwargs):
    return _axes(lambda v, a: function(name)(getattr(v, domain), axis=a, **kwargs))


#: Why a function of `keras.ops` is not applied: it takes no tensor to a tensor.
NOT_A_TENSOR_MAP = {
    "arange": "makes a tensor from numbers",
    "eye": "makes a tensor from numbers",
    "identity": "makes a tensor from a number",
    "tri": "makes a tensor from numbers",
    "zeros": "makes a tensor from a shape",
    "ones": "makes a tensor from a shape",
    "full": "makes a tensor from a shape",
    "empty": "makes a tensor from a shape",
    "linspace": "makes a tensor from numbers",
    "logspace": "makes a tensor from numbers",
    "geomspace": "makes a tensor from numbers",
    "bartlett": "a window of a length",
    "blackman": "a window of a length",
    "hamming": "a window of a length",
    "hanning": "a window of a length",
    "kaiser": "a window of a length",
    "shape": "a Python tuple",
    "dtype": "a Python string",
    "ndim": "a Python number",
    "is_tensor": "a Python bool",
    "convert_to_numpy": "a numpy array, outside the graph",
}

UNARY = """abs absolute angle arcsinh arctan cbrt ceil celu conj conjugate copy cos cosh deg2rad elu
    erf erfc exp exp2 expm1 fabs floor gelu hard_shrink hard_sigmoid hard_silu hard_tanh i0 imag
    isfinite isinf isnan isneginf isposinf isreal leaky_relu log_sigmoid negative rad2deg real
    relu relu6 round selu sigmoid sign signbit silu sin sinc sinh soft_shrink softplus softsign
    sparse_plus sparse_sigmoid square squareplus stop_gradient tan tanh tanh_shrink trunc
    nan_to_num convert_to_tensor zeros_like ones_like empty_like array"""
SEGMENTS = "segment_sum segment_max segment_min segment_prod"
POSITIVE = "log log10 log1p log2 sqrt rsqrt reciprocal"
UNIT = "arcsin arccos arctanh erfinv"
#: Of symmetric positive definite matrices.
SYMMETRIC = "det inv logdet slogdet cholesky eig eigh lu_factor qr svd pinv matrix_rank"
BINARY = """add subtract multiply divide true_divide maximum minimum fmax fmin arctan2 hypot
    logaddexp logaddexp2 equal not_equal greater greater_equal less less_equal nextafter
    heaviside isclose"""
BITWISE = """bitwise_and bitwise_or bitwise_xor gcd lcm left_shift right_shift bitwise_left_shift
    bitwise_right_shift"""
REDUCTIONS = """sum mean max min amax amin prod std var any all logsumexp median ptp nansum nanmean
    nanmax nanmin nanprod nanstd nanvar nanmedian count_nonzero"""
ALONG = """argmax argmin nanargmax nanargmin cumsum cumprod nancumsum nancumprod sort argsort
    softmax log_softmax"""

OPS: dict = {}
OPS.update({n: _unary(n) for n in UNARY.split()})
OPS.update({n: _unary(n, "pos") for n in POSITIVE.split()})
OPS.update({n: _unary(n, "unit") for n in UNIT.split()})
OPS["arccosh"] = lambda v: ops.arccosh(v.pos + 0.6)
OPS["full_like"] = lambda v: ops.full_like(v.h, 2.0)


def _segments(name: str):
    """By each row's first value; an empty segment's maximum (the lowest number) kept finite."""

    def apply(v):
        found = function(name)(v.h, v.ints[:, 0], num_segments=8)
        return ops.where(ops.abs(found) < 1e30, found, 0.0)

    return apply


OPS.update({n: _segments(n) for n in SEGMENTS.split()})
OPS.update({n: _binary(n) for n in BINARY.split()})
OPS.update(
    {
        n: _binary(n, "pos", lambda v: ops.flip(v.pos, axis=1))
        for n in ["power", "fmod", "mod", "floor_divide", "divide_no_nan"]
    }
)
OPS.update(
    {
        n: (lambda v, n=n: function(n)(v.ints, ops.flip(v.ints, axis=1) % 3 + 1))
        for n in BITWISE.split()
    }
)
OPS.update({n: (lambda v, n=n: function(n)(v.ints)) for n in ["bitwise_invert", "bitwise_not"]})
OPS.update(
    {
        n: (lambda v, n=n: function(n)(v.bools, ops.flip(v.bools, axis=1)))
        for n in ["logical_and", "logical_or", "logical_xor"]
    }
)
OPS["logical_not"] = lambda v: ops.logical_not(v.bools)
OPS.update({n: _reduction(n) for n in REDUCTIONS.split()})
OPS.update({n: _reduction(n) for n in ALONG.split() if n not in ("softmax", "log_softmax")})
OPS["softmax"] = _axes(lambda v, a: ops.softmax(v.h, axis=a), (0, -1))
OPS["log_softmax"] = _axes(lambda v, a: ops.log_softmax(v.h, axis=a), (0, -1))
OPS["sparsemax"] = _axes(lambda v, a: ops.sparsemax(v.h, axis=a), (0, -1))
OPS["glu"] = _axes(lambda v, a: ops.glu(v.h[:6], axis=a) if a == 0 else ops.glu(v.h, axis=a), (-1,))
OPS["average"] = _axes(lambda v, a: ops.average(v.h, axis=a))
OPS["norm"] = _axes(lambda v, a: ops.norm(v.h, axis=a))
OPS["normalize"] = _axes(lambda v, a: ops.normalize(v.h, axis=a), (0, -1))
OPS["rms_normalization"] = _axes(lambda v, a: ops.rms_normalization(v.h, axis=a), (0, -1))
OPS["layer_normalization"] = _axes(lambda v, a: ops.layer_normalization(v.h, axis=a), (0, -1))
OPS["moments"] = _axes(
    lambda v, a: ops.moments(v.h, axes=[0] if a == 0 else [0, 1] if a is None else [1])
)
OPS["batch_normalization"] = lambda v: ops.batch_normalization(
    v.h, ops.mean(v.h, axis=0), ops.var(v.h, axis=0), axis=-1
)
OPS["percentile"] = _axes(lambda v, a: ops.percentile(v.h, 30.0, axis=a))
OPS["quantile"] = _axes(lambda v, a: ops.quantile(v.h, 0.3, axis=a))
OPS["nanpercentile"] = _axes(lambda v, a: ops.nanpercentile(v.h, 30.0, axis=a))
OPS["nanquantile"] = _axes(lambda v, a: ops.nanquantile(v.h, 0.3, axis=a))
OPS["flip"] = _axes(lambda v, a: ops.flip(v.h, axis=a))
OPS["roll"] = _axes(lambda v, a: ops.roll(v.h, 1, axis=a))
OPS["diff"] = _axes(lambda v, a: ops.diff(v.h, axis=a), (0, -1))
OPS["trapezoid"] = _axes(lambda v, a: ops.trapezoid(v.h, axis=a), (0, -1))
OPS["top_k"] = lambda v: ops.top_k(v.h, 3)
OPS["argpartition"] = _axes(lambda v, a: ops.argpartition(v.h, 1, axis=a), (0, -1))
OPS["repeat"] = _axes(lambda v, a: ops.repeat(v.h, 2, axis=a))
OPS["split"] = _axes(lambda v, a: ops.split(v.h, [1] if a == 0 else 2, axis=a), (0, -1))
OPS["array_split"] = _axes(lambda v, a: ops.array_split(v.h, 2, axis=a), (-1,))
OPS["unstack"] = _axes(lambda v, a: ops.unstack(v.h, axis=a), (-1,))
OPS["stack"] = _axes(lambda v, a: ops.stack([v.h, ops.flip(v.h, axis=1)], axis=a), (0, -1))
OPS["concatenate"] = {
    "rows": lambda v: ops.concatenate([v.h, v.table[:1]], axis=0),
    "rows with rows": lambda v: ops.concatenate([v.h, ops.flip(v.h, axis=1)], axis=0),
    "last": lambda v: ops.concatenate([v.h, v.pos], axis=-1),
}
OPS["append"] = {
    "rows": lambda v: ops.append(v.h, v.table[:1], axis=0),
    "all": lambda v: ops.append(v.h, v.pos),
    "last": lambda v: ops.append(v.h, v.pos, axis=-1),
}
OPS["hstack"] = lambda v: ops.hstack([v.h, v.pos])
OPS["vstack"] = lambda v: ops.vstack([v.h, v.table[:2]])
OPS["dstack"] = lambda v: ops.dstack([v.h, v.pos])
OPS["hsplit"] = lambda v: ops.hsplit(v.h, 2)
OPS["vsplit"] = lambda v: ops.vsplit(ops.concatenate([v.img, v.img], axis=0), 2)
OPS["dsplit"] = lambda v: ops.dsplit(v.img, 2)
OPS["take"] = {
    "rows": lambda v: ops.take(v.h, [0, 2], axis=0),
    "all": lambda v: ops.take(v.h, [3, 5]),
    "last": lambda v: ops.take(v.h, [1, 2, 7], axis=-1),
}
OPS["take_along_axis"] = _axes(
    lambda v, a: ops.take_along_axis(
        v.h, ops.argsort(v.h, axis=a) if a is not None else ops.argsort(ops.ravel(v.h)), axis=a
    )
)
OPS["get_item"] = {
    "rows": lambda v: ops.get_item(v.h, 0),
    "last": lambda v: ops.get_item(v.h, (slice(None), 3)),
}
OPS["slice"] = {
    "rows": lambda v: ops.slice(v.h, [1, 0], [2, 8]),
    "last": lambda v: ops.slice(v.h, [0, 2], [ops.shape(v.h)[0], 3]),
}
OPS["slice_update"] = {
    "rows": lambda v: ops.slice_update(v.h, [0, 0], v.table[:1]),
    "last": lambda v: ops.slice_update(v.h, [0, 2], ops.zeros_like(v.h[:, :2])),
}
OPS["scatter_update"] = lambda v: ops.scatter_update(v.h, [[0, 1]], ops.ones((1,), v.h.dtype))
OPS["scatter"] = lambda v: ops.scatter(ops.expand_dims(v.ints[:, 0], -1), v.h[:, 0], (8,))
OPS["where"] = {
    "select": lambda v: ops.where(v.bools, v.h, v.pos),
    "indices": lambda v: ops.where(v.bools),
}
OPS["nonzero"] = lambda v: ops.nonzero(v.bools)
OPS["select"] = lambda v: ops.select([v.bools, v.h < -0.5], [v.h, v.pos], 0.0)
OPS["clip"] = lambda v: ops.clip(v.h, -0.5, 0.5)
OPS["threshold"] = lambda v: ops.threshold(v.h, 0.2, 0.0)
OPS["cast"] = lambda v: ops.cast(v.h, "float32")
OPS["saturate_cast"] = lambda v: ops.saturate_cast(v.h * 300.0, "int8")
OPS["view"] = lambda v: ops.view(v.h, "int64") % 7
OPS["view_as_complex"] = lambda v: v.cplx
OPS["view_as_real"] = lambda v: ops.view_as_real(v.cplx)
OPS["polar"] = lambda v: ops.polar(v.pos, v.h)
OPS["fft"] = lambda v: ops.fft((v.h[:, :4], v.h[:, 4:]))
OPS["fft2"] = lambda v: ops.fft2((v.img[..., 0], v.img[..., 1]))
OPS["ifft2"] = lambda v: ops.ifft2((v.img[..., 0], v.img[..., 1]))
OPS["rfft"] = lambda v: ops.rfft(v.h)
OPS["irfft"] = lambda v: ops.irfft((v.h[:, :5], v.pos[:, :5]))
OPS["stft"] = lambda v: ops.stft(v.h, 4, 2, 4, center=False)
OPS["istft"] = lambda v: ops.istft(
    (ops.reshape(v.h[:, :6], (-1, 2, 3)), ops.reshape(v.h[:, 2:], (-1, 2, 3))),
    4,
    2,
    4,
    center=False,
)
OPS["expand_dims"] = {
    "rows": lambda v: ops.expand_dims(v.h, 0),
    "last": lambda v: ops.expand_dims(v.h, -1),
}
OPS["squeeze"] = lambda v: ops.squeeze(ops.expand_dims(v.h, -1), axis=-1)
OPS["reshape"] = {
    "rows regrouped": lambda v: ops.reshape(v.h, (2, -1, 4)),
    "each row's values": lambda v: ops.reshape(v.h, (-1, 4, 2)),
    "all": lambda v: ops.reshape(v.h, (-1,)),
}
OPS["ravel"] = lambda v: ops.ravel(v.h)
OPS["transpose"] = lambda v: ops.transpose(v.h)
OPS["swapaxes"] = {
    "rows": lambda v: ops.swapaxes(v.h, 0, 1),
    "last": lambda v: ops.swapaxes(v.seq, 1, 2),
}
OPS["moveaxis"] = {
    "rows": lambda v: ops.moveaxis(v.seq, 0, -1),
    "last": lambda v: ops.moveaxis(v.seq, 1, 2),
}
OPS["rearrange"] = {
    "rows": lambda v: ops.rearrange(v.seq, "b t c -> t (b c)"),
    "last": lambda v: ops.rearrange(v.seq, "b t c -> b (c t)"),
}
OPS["rot90"] = {"rows": lambda v: ops.rot90(v.h), "last": lambda v: ops.rot90(v.img, axes=(1, 2))}
OPS["fliplr"] = lambda v: ops.fliplr(v.h)
OPS["flipud"] = lambda v: ops.flipud(v.h)
OPS["tile"] = {"rows": lambda v: ops.tile(v.h, (2, 1)), "last": lambda v: ops.tile(v.h, (1, 2))}
OPS["broadcast_to"] = lambda v: ops.broadcast_to(ops.expand_dims(v.h, 1), (ops.shape(v.h)[0], 3, 8))
OPS["pad"] = {
    "rows": lambda v: ops.pad(v.h, [[1, 2], [0, 0]]),
    "last": lambda v: ops.pad(v.h, [[0, 0], [1, 2]]),
    "reflected": lambda v: ops.pad(v.h, [[0, 0], [2, 2]], mode="reflect"),
}
OPS["tril"] = {"rows": lambda v: ops.tril(v.h), "last": lambda v: ops.tril(v.mat)}
OPS["triu"] = {"rows": lambda v: ops.triu(v.h), "last": lambda v: ops.triu(v.mat)}
OPS["diag"] = lambda v: ops.diag(v.h)
OPS["diagflat"] = lambda v: ops.diagflat(v.h[:2])
OPS["diagonal"] = {
    "rows": lambda v: ops.diagonal(v.h),
    "last": lambda v: ops.diagonal(v.mat, axis1=-2, axis2=-1),
}
OPS["trace"] = {
    "rows": lambda v: ops.trace(v.h),
    "last": lambda v: ops.trace(v.mat, axis1=-2, axis2=-1),
}
OPS["matmul"] = {
    "a kernel": lambda v: ops.matmul(v.h, v.table),
    "rows with rows": lambda v: ops.matmul(v.h, ops.transpose(v.h)),
    "over the rows": lambda v: ops.matmul(ops.transpose(v.h), v.h),
}
OPS["dot"] = {
    "a kernel": lambda v: ops.dot(v.h, v.table),
    "rows with rows": lambda v: ops.dot(v.h, ops.transpose(v.h)),
}
OPS["tensordot"] = {
    "a kernel": lambda v: ops.tensordot(v.h, v.table, axes=1),
    "over the rows": lambda v: ops.tensordot(v.h, v.h, axes=[[0], [0]]),
}
OPS["einsum"] = {
    "a kernel": lambda v: ops.einsum("bi,ij->bj", v.h, v.table),
    "over the rows": lambda v: ops.einsum("bi,bj->ij", v.h, v.h),
    "each row": lambda v: ops.einsum("bi,bi->b", v.h, v.pos),
}
# (With a table of another row count, Keras' `inner` fails to trace on a batch of a known size.)
OPS["inner"] = lambda v: ops.inner(v.h, v.h)
OPS["outer"] = lambda v: ops.outer(v.h[:, 0], v.h[:, 1])
OPS["vdot"] = lambda v: ops.vdot(v.h, v.pos)
OPS["kron"] = lambda v: ops.kron(v.h, v.table[:2, :2])
OPS["cross"] = lambda v: ops.cross(v.h[:, :3], v.h[:, 3:6])
OPS["cdist"] = {
    "rows with a table": lambda v: ops.cdist(v.h, v.table),
    "rows with rows": lambda v: ops.cdist(v.h, v.h),
}
OPS["correlate"] = lambda v: ops.correlate(v.h[:, 0], v.table[0, :2])
OPS["corrcoef"] = {
    "rows": lambda v: ops.corrcoef(v.h),
    "features": lambda v: ops.corrcoef(ops.transpose(v.h)),
}
OPS["vander"] = lambda v: ops.vander(v.h[:, 0], 3)
OPS["meshgrid"] = lambda v: ops.meshgrid(v.h[:, 0], v.table[0])
OPS["histogram"] = lambda v: ops.histogram(v.h[:, 0], bins=4, range=(-1.0, 1.0))
OPS["bincount"] = lambda v: ops.bincount(ops.ravel(v.ints), minlength=8)
OPS["digitize"] = lambda v: ops.digitize(v.h, [-0.5, 0.0, 0.5])
OPS["searchsorted"] = lambda v: ops.searchsorted(
    ops.convert_to_tensor([-0.5, 0.0, 0.5], v.h.dtype), ops.ravel(v.h)
)
OPS["isin"] = lambda v: ops.isin(v.ints, [1, 3])
OPS["unique"] = lambda v: ops.unique(v.ints[:, 0], size=8, fill_value=0)
OPS["unravel_index"] = lambda v: ops.unravel_index(v.ints, (2, 4))
OPS["one_hot"] = lambda v: ops.one_hot(v.ints, 8)
OPS["multi_hot"] = lambda v: ops.multi_hot(v.ints, 8)
OPS["in_top_k"] = lambda v: ops.in_top_k(v.ints[:, 0], ops.cast(v.h, "float32"), 3)
OPS["count_nonzero"] = _axes(lambda v, a: ops.count_nonzero(v.bools, axis=a))
OPS["allclose"] = lambda v: ops.allclose(v.h, ops.flip(v.h, axis=1))
OPS["ldexp"] = lambda v: ops.ldexp(v.h, v.ints % 3)
OPS["round"] = lambda v: ops.round(v.h, 1)
OPS["size"] = lambda v: ops.size(v.h)
OPS.update({n: _unary(n, "spd") for n in SYMMETRIC.split()})
OPS["cholesky_inverse"] = lambda v: ops.cholesky_inverse(ops.cholesky(v.spd))
OPS["solve"] = lambda v: ops.solve(v.spd, v.mat)
OPS["solve_triangular"] = lambda v: ops.solve_triangular(v.lower, v.mat, lower=True)
OPS["lstsq"] = lambda v: ops.lstsq(v.spd[0, 0], v.mat[0, 0])
OPS["binary_crossentropy"] = lambda v: ops.binary_crossentropy(
    ops.sigmoid(ops.flip(v.h, 1)), ops.sigmoid(v.h)
)
OPS["categorical_crossentropy"] = lambda v: ops.categorical_crossentropy(
    ops.softmax(ops.flip(v.h, 1)), ops.softmax(v.h)
)
OPS["sparse_categorical_crossentropy"] = lambda v: ops.sparse_categorical_crossentropy(
    v.ints[:, 0], ops.softmax(v.h)
)
OPS["psnr"] = lambda v: ops.psnr(v.pos, ops.flip(v.pos, 1), 3.0)
OPS["dot_product_attention"] = {
    "each row": lambda v: ops.dot_product_attention(
        v.seq[:, :, None], v.seq[:, :, None], v.seq[:, :, None]
    ),
    "over the rows": lambda v: ops.dot_product_attention(v.seq[None], v.seq[None], v.seq[None]),
}
OPS["ctc_loss"] = lambda v: ops.ctc_loss(
    v.ints[:, :2] % 2 + 1,
    ops.softmax(v.seq),
    ops.full_like(v.ints[:, 0], 2),
    ops.full_like(v.ints[:, 0], 4),
)
OPS["ctc_decode"] = lambda v: ops.ctc_decode(ops.softmax(v.seq), ops.full_like(v.ints[:, 0], 4))[0]
OPS["conv"] = {
    "each row": lambda v: ops.conv(v.seq, ops.ones((2, 2, 3), v.h.dtype)),
    "along the rows": lambda v: ops.conv(v.h[None], ops.ones((2, 8, 3), v.h.dtype)),
}
OPS["conv_transpose"] = lambda v: ops.conv_transpose(
    v.seq, ops.ones((2, 3, 2), v.h.dtype), strides=2
)
OPS["depthwise_conv"] = lambda v: ops.depthwise_conv(v.seq, ops.ones((2, 2, 1), v.h.dtype))
OPS["separable_conv"] = lambda v: ops.separable_conv(
    v.seq, ops.ones((2, 2, 1), v.h.dtype), ops.ones((1, 2, 3), v.h.dtype)
)
OPS["max_pool"] = {
    "each row": lambda v: ops.max_pool(v.seq, 2),
    "along the rows": lambda v: ops.max_pool(v.h[None], 2),
}
OPS["average_pool"] = {
    "each row": lambda v: ops.average_pool(v.seq, 2),
    "along the rows": lambda v: ops.average_pool(v.h[None], 2),
}
OPS["adaptive_max_pool"] = lambda v: ops.adaptive_max_pool(v.seq, 2)
OPS["adaptive_average_pool"] = lambda v: ops.adaptive_average_pool(v.seq, 2)
OPS["extract_sequences"] = lambda v: ops.extract_sequences(v.h, 4, 2)
OPS["unfold"] = lambda v: ops.unfold(ops.moveaxis(v.img, -1, 1), 2)
OPS["fold"] = lambda v: ops.fold(ops.reshape(v.h, (-1, 4, 2)), (2, 3), (2, 2))
OPS["depth_to_space"] = lambda v: ops.depth_to_space(ops.reshape(v.h, (-1, 1, 2, 4)), 2)
OPS["space_to_depth"] = lambda v: ops.space_to_depth(v.img, 2)
OPS["image.resize"] = lambda v: ops.image.resize(v.img, (3, 3))
OPS["image.affine_transform"] = lambda v: ops.image.affine_transform(
    v.img, ops.convert_to_tensor([1.0, 0.1, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], v.h.dtype)
)
OPS["image.crop_images"] = lambda v: ops.image.crop_images(
    v.img, 0, 0, target_height=1, target_width=1
)
OPS["image.pad_images"] = lambda v: ops.image.pad_images(
    v.img, 1, 1, target_height=4, target_width=4
)
OPS["image.extract_patches"] = lambda v: ops.image.extract_patches(v.img, 1)
OPS["image.extract_patches_3d"] = lambda v: ops.image.extract_patches_3d(
    ops.reshape(v.h, (-1, 2, 2, 2, 1)), 1
)
OPS["image.gaussian_blur"] = lambda v: ops.image.gaussian_blur(v.img)
OPS["image.hsv_to_rgb"] = lambda v: ops.image.hsv_to_rgb(
    ops.concatenate([v.img, v.img[..., :1]], -1) * 0.5 + 0.5
)
OPS["image.rgb_to_hsv"] = lambda v: ops.image.rgb_to_hsv(
    ops.concatenate([v.img, v.img[..., :1]], -1) * 0.5 + 0.5
)
OPS["image.rgb_to_grayscale"] = lambda v: ops.image.rgb_to_grayscale(
    ops.concatenate([v.img, v.img[..., :1]], -1)
)
OPS["image.sobel_edges"] = lambda v: ops.image.sobel_edges(v.img)
OPS["image.map_coordinates"] = lambda v: ops.image.map_coordinates(
    v.table, ops.stack([v.pos[:, 0], v.pos[:, 1]]), 1
)
OPS["image.perspective_transform"] = lambda v: ops.image.perspective_transform(
    v.img, [[0, 0], [1, 0], [0, 1], [1, 1]], [[0, 0], [1.0, 0.1], [0, 1], [1, 1]]
)
OPS["image.scale_and_translate"] = lambda v: ops.image.scale_and_translate(
    v.img, (ops.shape(v.h)[0], 3, 3, 2), [1.5, 1.5], [0.0, 0.0], [1, 2], "bilinear"
)
# On a batch of a size the trace does not know, Keras draws its noise for one image: the first.
OPS["image.elastic_transform"] = lambda v: ops.image.elastic_transform(v.img[:1], seed=3)
OPS["image.ssim"] = lambda v: ops.image.ssim(
    v.img * 0.5 + 0.5, ops.flip(v.img, 1) * 0.5 + 0.5, filter_size=1
)
# Control constructs and functions of functions.
OPS["cond"] = lambda v: ops.cond(ops.mean(v.h) > 0, lambda: v.h * 2.0, lambda: v.h - 1.0)
OPS["switch"] = lambda v: ops.switch(
    ops.cast(ops.mean(v.h) > 0, "int32"), [lambda x: x * 2.0, lambda x: x - 1.0], v.h
)
OPS["while_loop"] = lambda v: ops.while_loop(
    lambda i, x: i < 3, lambda i, x: (i + 1, x * 0.5 + ops.mean(x, axis=0)), (0, v.h)
)[1]
OPS["fori_loop"] = lambda v: ops.fori_loop(0, 3, lambda i, x: x * 0.5 + 1.0, v.h)
OPS["scan"] = {
    "over the rows": lambda v: ops.scan(lambda c, x: (c + x, c * x), ops.zeros_like(v.h[0]), v.h)[
        1
    ],
    "each row": lambda v: ops.scan(
        lambda c, x: (c + x, c * x), ops.zeros_like(v.h[:, 0]), ops.transpose(v.h)
    )[1],
}
# Over an axis of a length the trace does not know (the rows), TensorFlow's associative scan
# builds its graph without end, on one device too: over the last axis only.
OPS["associative_scan"] = _axes(
    lambda v, a: ops.associative_scan(lambda x, y: x + y, v.h, axis=a), (-1,)
)
OPS["map"] = lambda v: ops.map(lambda row: row * ops.sum(row), v.h)
OPS["vectorized_map"] = lambda v: ops.vectorized_map(lambda row: row * ops.sum(row), v.h)
OPS["vectorize"] = lambda v: ops.vectorize(lambda a: a * 2.0 + 1.0)(v.h)
OPS["jvp"] = lambda v: ops.jvp(ops.sin, (v.h,), (ops.ones_like(v.h),))[1]


def _square(x):
    @ops.custom_gradient
    def square(x):
        return x * x, lambda upstream: 2.0 * x * upstream

    return square(x)


OPS["custom_gradient"] = lambda v: _square(v.h)
