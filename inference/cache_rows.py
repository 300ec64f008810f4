"""The one module that reaches inside transformers' KV cache: the rows of a batch's cache are
added, removed and re-aligned here, and nowhere else.

transformers has no public way to put two caches side by side, so a batch whose sequences come
and go edits its ``DynamicCache`` directly. What it relies on (transformers 5.24):

* ``DynamicCache.layers``: one layer object per decoder layer;
* ``DynamicLayer.keys`` / ``.values``: tensors ``[batch, kv_heads, positions, head_dim]``, which
  its ``update`` concatenates along ``positions`` each step (so replacing them between steps is
  safe: the next step concatenates onto whatever is there, and the tensors it made are the
  cache's alone, so a row may be overwritten in place);
* ``DynamicLayer.lazy_initialization`` and ``is_initialized``, for :func:`append`, the
  serving forward's ``update``: it writes a step's columns into spare capacity allocated with
  the layer's tensors instead of concatenating (which copies the whole cache every step: 17%
  of an 8-row step), and leaves ``keys`` / ``values`` views of that buffer, so every edit
  here (views, in-place row copies, new tensors) stays valid.

Everything else is public: a cache is built through ``DynamicCache.update``. :func:`check`
runs when a local model is served with batching (:func:`check_cache` on a prompt's first
cache, for the prefix cache alone): a model whose cache is not made of plain ``DynamicLayer`` s
(sliding windows, linear attention), or a transformers without these attributes, is served
without batching (one sequence at a time, which needs none of this), and the reason is logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger("sluice.inference")

# The transformers releases this module was tested with (pyproject.toml declares the same).
TESTED_RANGE = ">=5.24,<5.25"

# Per layer: (keys, values), each [rows, kv_heads, positions, head_dim].
Rows = list[tuple[Any, Any]]


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def in_tested_range(installed: str) -> bool:
    floor, below = re.findall(r"[\d.]+", TESTED_RANGE)
    return _release(floor) <= _release(installed) < _release(below)


def check(model: Any) -> str | None:
    """None when batching can edit this model's cache; otherwise why not (logged once). A
    transformers outside the tested range is logged, and its attributes decide."""
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return "transformers is not installed"
    if not in_tested_range(installed):
        log.warning(
            "transformers %s is outside the range batching is tested with (%s); its cache "
            "is checked attribute by attribute",
            installed,
            TESTED_RANGE,
        )
    try:
        import torch
        from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: F401 - both must exist
    except ImportError as error:
        return f"transformers has no DynamicCache/DynamicLayer ({error})"
    try:
        with torch.inference_mode():
            output = model(
                input_ids=torch.tensor([[0]]),
                cache=DynamicCache(config=model.config),
                use_cache=True,
                logits_to_keep=1,
            )
    except Exception as error:  # noqa: BLE001 - start-up, in a thread: no Cancelled here
        return f"a forward pass with a DynamicCache failed ({type(error).__name__}: {error})"
    return check_cache(getattr(output, "cache", None))


def check_cache(cache: Any) -> str | None:
    """None when this cache (a forward pass's) is made of rows this module can edit;
    otherwise why not."""
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers:
        return "the model's forward pass returns no DynamicCache with layers"
    for layer in layers:
        if type(layer) is not DynamicLayer:
            return f"its cache has {type(layer).__name__} layers (only DynamicLayer is batched)"
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return "DynamicLayer has no keys/values tensors"
        if keys.dim() != 4 or keys.shape[0] != 1:
            return (
                f"DynamicLayer.keys has shape {tuple(keys.shape)}, not [1, heads, positions, dim]"
            )
    return None


# Spare columns a layer's buffer gets when it is (re)allocated: a step writes into them in place,
# and the buffer is copied once per this many steps, or when a row joins.
SPARE_COLUMNS = 64


def empty(config: Any) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


def append(cache: Any, index: int, keys: Any, values: Any) -> tuple[Any, Any]:
    """Layer ``index``'s keys and values with ``keys`` / ``values`` (``[rows, heads, new,
    dim]``) added after its last column: what ``DynamicCache.update`` returns, written into the
    layer's buffer while the layer's tensors are still views of it with room after them."""
    layer = cache.layers[index]
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    old_keys, old_values = layer.keys, layer.values
    added = keys.shape[2]
    if old_keys.numel() == 0:
        old_keys = old_values = None
    buffers: tuple[Any, Any] | None = getattr(layer, "sluice_buffers", None)
    place = None
    if buffers is not None and old_keys is not None and old_keys.shape[0] == keys.shape[0]:
        place = _place(old_keys, buffers[0])
        if place is not None and (
            _place(old_values, buffers[1]) != place
            or place + old_keys.shape[2] + added > buffers[0].shape[2]
        ):
            place = None
    if place is not None and buffers is not None:
        start, end = place, place + old_keys.shape[2]
    else:
        start, end = 0, (0 if old_keys is None else old_keys.shape[2])
        shape = list(keys.shape)
        shape[2] = end + added + SPARE_COLUMNS
        buffers = (keys.new_empty(shape), values.new_empty(shape))
        if old_keys is not None:
            buffers[0][:, :, :end] = old_keys
            buffers[1][:, :, :end] = old_values
        layer.sluice_buffers = buffers
    rows = keys.shape[0]
    key_buffer, value_buffer = buffers
    key_buffer[:rows, :, end : end + added] = keys
    value_buffer[:rows, :, end : end + added] = values
    layer.keys = key_buffer[:rows, :, start : end + added]
    layer.values = value_buffer[:rows, :, start : end + added]
    return layer.keys, layer.values


def _place(tensor: Any, buffer: Any) -> int | None:
    """The first column of ``buffer`` that ``tensor`` (a view of its first rows) starts at, or
    None when ``tensor`` is not such a view."""
    if (
        tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        or tensor.stride() != buffer.stride()
        or tensor.shape[0] > buffer.shape[0]
        or tensor.shape[1:2] != buffer.shape[1:2]
        or tensor.shape[3:] != buffer.shape[3:]
    ):
        return None
    offset = tensor.storage_offset() - buffer.storage_offset()
    column, rest = divmod(offset, buffer.stride(2))
    if rest or not 0 <= column < buffer.shape[2] or offset >= buffer.stride(1):
        return None
    return int(column)


def length(cache: Any) -> int:
    return int(cache.get_seq_length())


def rows_of(cache: Any) -> Rows:
    """The cache's tensors (not copied)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def take_row(cache: Any, index: int, first_column: int) -> Rows:
    """Row ``index`` from ``first_column`` on (its padding left out), copied, so that the
    batch's tensors can be freed once the batch moves on."""
    return [
        (
            keys[index : index + 1, :, first_column:].clone(),
            values[index : index + 1, :, first_column:].clone(),
        )
        for keys, values in rows_of(cache)
    ]


def cache_from_rows(config: Any, rows: Rows) -> Any:
    """A new cache holding ``rows``, built through the cache's public ``update``."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(rows):
        cache.update(keys, values, index)
    return cache


def _pad_left(tensor: Any, columns: int) -> Any:
    import torch

    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=2)


def append_rows(cache: Any, rows: Rows) -> tuple[int, int]:
    """Add ``rows`` below the cache's rows, right-aligned: whichever is shorter is padded on
    the left. Returns (columns added before the cache's old rows, before the new rows)."""
    import torch

    old_length = length(cache)
    new_length = int(rows[0][0].shape[2])
    old_pad = max(0, new_length - old_length)
    new_pad = max(0, old_length - new_length)
    for layer, (keys, values) in zip(cache.layers, rows, strict=True):
        layer.keys = torch.cat([_pad_left(layer.keys, old_pad), _pad_left(keys, new_pad)], dim=0)
        layer.values = torch.cat(
            [_pad_left(layer.values, old_pad), _pad_left(values, new_pad)], dim=0
        )
    return old_pad, new_pad


def remove_rows(cache: Any, indices: Sequence[int], rows: int) -> list[int]:
    """Remove rows ``indices`` of ``rows``; return the old index of each row that stays, in
    its new order. A removed row's place is taken by the last row (one row copied, in place),
    and the tail is cut off as a view, so that a leave does not copy the whole batch's cache."""
    import torch

    order = list(range(rows))
    for index in sorted(set(indices), reverse=True):
        last = len(order) - 1
        if index != last:
            with torch.inference_mode():
                for layer in cache.layers:
                    layer.keys[index] = layer.keys[last]
                    layer.values[index] = layer.values[last]
            order[index] = order[last]
        order.pop()
    for layer in cache.layers:
        layer.keys = layer.keys[: len(order)]
        layer.values = layer.values[: len(order)]
    return order


def drop_left(cache: Any, columns: int) -> None:
    """Drop the first ``columns`` positions of every row (padding no row needs any more)."""
    if columns <= 0:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, columns:]
        layer.values = layer.values[:, :, columns:]
