"""Byte sizes of payloads from shape and dtype, without forcing lazy (MLX) evaluation."""

from __future__ import annotations

import math
from collections.abc import Mapping


def array_nbytes(array: object) -> int:
    """Bytes of an mlx or numpy array: prod(shape) * element size.

    Reads only ``shape`` and ``dtype``, so an unevaluated mlx array stays unevaluated.

    Raises:
        TypeError: ``array`` has no shape and dtype.
    """
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"expected an array with shape and dtype, got {type(array).__name__}")
    # mlx dtypes expose .size (bytes per element); numpy dtypes expose .itemsize.
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:
        itemsize = dtype.size
    return math.prod(shape) * int(itemsize)


def tree_nbytes(obj: object) -> int:
    """Total bytes of the arrays in nested tuples, lists and dicts (None counts 0).

    Raises:
        TypeError: A leaf is neither an array nor None.
    """
    if obj is None:
        return 0
    if isinstance(obj, (tuple, list)):
        return sum(tree_nbytes(item) for item in obj)
    if isinstance(obj, Mapping):
        return sum(tree_nbytes(item) for item in obj.values())
    return array_nbytes(obj)
