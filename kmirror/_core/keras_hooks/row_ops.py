"""What kmirror says of an operation over the rows of a layer call (`reductions`): the axes a
product contracts, and the error for one it cannot make the whole batch's."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["PRODUCTS", "contracted", "refusal"]

PRODUCTS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")


def contracted(op_type: str, given: dict) -> tuple[list, list, list]:
    """A product's operands and, for each, the axes it contracts, and those it pairs with the
    other operands' axes in its output (None where not known)."""
    if op_type == "Einsum":
        operands = list(given["inputs"])
        equation = given["equation"].replace(" ", "")
        if "..." in equation or "->" not in equation:
            return operands, [None] * len(operands), [None] * len(operands)
        inputs, output = equation.split("->")
        specs = inputs.split(",")
        shared = {label for spec in specs for label in spec if sum(label in s for s in specs) > 1}
        return (
            operands,
            [{a for a, label in enumerate(spec) if label not in output} for spec in specs],
            [
                {a for a, label in enumerate(spec) if label in output and label not in shared}
                for spec in specs
            ],
        )
    first, second = list(given.values())[:2]
    flipped = [
        given.get("transpose_a", given.get("adj_x", False)),
        given.get("transpose_b", given.get("adj_y", False)),
    ]
    found, kept = [], []
    for tensor, flip, inner in zip((first, second), flipped, (True, False)):
        rank = tensor.shape.rank if tf.is_tensor(tensor) else None
        if rank is None or rank < 2:
            found.append(None)
            kept.append(None)
            continue
        # a's columns (its rows when transposed), b's rows (its columns when transposed)
        last = rank - 1 if inner != bool(flip) else rank - 2
        found.append({last})
        kept.append({2 * rank - 3 - last})  # the other of its last two axes
    return [first, second], found, kept


_NAMES = {
    "Sum": "a sum",
    "Mean": "a mean",
    "Max": "a maximum",
    "Min": "a minimum",
    "Prod": "a product",
    "EuclideanNorm": "a norm",
    "ArgMax": "an arg-max",
    "ArgMin": "an arg-min",
    "Cumsum": "a cumulative sum",
    "Cumprod": "a cumulative product",
    "TopKV2": "a top-k or a sort",
    "MatMul": "a matrix product",
    "BatchMatMulV2": "a matrix product",
    "BatchMatMulV3": "a matrix product",
    "Einsum": "an einsum",
}


def refusal(layer, op_type: str, held, axes) -> str:
    """The error for `op_type` over the rows `held` of a call of `layer`."""
    where = f"layer '{layer.name}' ({type(layer).__name__})"
    if op_type == "pairs":
        return (
            f"kmirror: {where} takes a product that pairs the rows of its call with each other "
            "(a similarity of every row with every other, `x @ tf.transpose(x)`). Each replica "
            "holds only its rows of the batch, so it would pair its rows only, not one device's "
            "whole batch. Compute it in the model's own train_step, on the whole batch, outside "
            "the layer's call."
        )
    if op_type in PRODUCTS:
        return (
            f"kmirror: {where} takes {_NAMES[op_type]} that contracts the rows of its call with "
            "axes of another operand that are not the same rows. Each replica holds only its "
            "rows of the batch, so the replicas would not compute one device's value. Contract "
            "rows with rows (x^T y), or compute it in the model's own train_step."
        )
    if op_type in ("Sum", "Mean"):
        return (
            f"kmirror: {where} takes {_NAMES[op_type]} over some of the axes that hold the rows "
            f"of its call (axes {sorted(axes)} of a tensor holding them in axes {sorted(held)}: "
            "the rows regrouped, as groups of rows each with its own statistic). Which rows a "
            "group holds depends on which rows each replica holds, so no replica can compute "
            "one device's value. Reduce over all the rows (a statistic of the whole batch), or "
            "over axes that do not hold them."
        )
    return (
        f"kmirror: {where} takes {_NAMES[op_type]} over the rows of its call (axes "
        f"{sorted(axes) if axes is not None else 'unknown'} of a tensor holding them in axes "
        f"{sorted(held)}). Each replica holds only its rows of the batch, and kmirror makes "
        "only sums and means over the rows the whole batch's, so the replicas would not compute "
        "one device's value. Write it with sums or means over the rows, or compute it in the "
        "model's own train_step outside the layer's call, on the whole batch."
    )
