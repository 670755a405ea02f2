"""KV slot write: store this step's new keys/values into the paged cache.

``k_cache``/``v_cache`` are one layer's strided views of the block-major cache,
``kv_cache[:, layer, 0]`` and ``kv_cache[:, layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` goes to slot
``slot_mapping[t] = block_id * block_size + offset``; a slot of -1 is padding
and is skipped. The caller owns all tensors; the caches are written in place.
"""

from __future__ import annotations

import torch

from kernels.dispatch import cpu_kernels, use_triton


def write_kv_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key[t]``/``value[t]`` (``[T, Hkv, D]``) into slot ``slot_mapping[t]`` of the caches."""
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"key {tuple(key.shape)} does not fit caches {tuple(k_cache.shape)}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != [{key.shape[0]}]")
    if key.shape[0] == 0:
        return
    if use_triton(key):
        from kernels.kv_write_triton import write_kv_slots_triton

        write_kv_slots_triton(key, value, k_cache, v_cache, slot_mapping)
    elif (cpp := cpu_kernels(key)) is not None and k_cache.dtype == v_cache.dtype == key.dtype == value.dtype:
        cpp.write_kv_slots(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_slots_ref(key, value, k_cache, v_cache, slot_mapping)


def write_kv_slots_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of ``write_kv_slots``: one ``index_put_`` per cache."""
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    block_size = k_cache.shape[1]
    index = (slots // block_size, slots % block_size)
    k_cache.index_put_(index, key.to(k_cache.dtype))
    v_cache.index_put_(index, value.to(v_cache.dtype))
