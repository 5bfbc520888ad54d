"""megatron's stand-in for apex's / TransformerEngine's multi-tensor l2 norm, where neither is installed (the
local backend's usual install), replaced by one that computes the same number without a host synchronisation
per parameter.

megatron's local l2 norm (every step's gradient norm) made a host tensor of the parameters' norms with
torch.tensor(list of device scalars): one device-to-host read each, hundreds per step at 3B, in the window
where the GPU waits for the host anyway (between the norm and the optimizer's launch).
"""
from __future__ import annotations

import torch
from megatron.core.optimizer import clip_grads
from megatron.core.utils import local_multi_tensor_l2_norm


def l2_norm_copied_once(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """local_multi_tensor_l2_norm's value: each tensor's norm on its device, the norm of those norms in fp32 on
    the host, as megatron takes it (a norm on the device could differ in the last bit), the norms copied there
    in one read rather than one each."""
    norms = torch.stack([torch.norm(tensor) for tensors in tensor_lists for tensor in tensors])
    total = torch.norm(norms.cpu().view(len(tensor_lists), -1))
    return total.to(torch.float32).reshape(1).to(norms.device), None


def use_sync_free_fallbacks() -> None:
    """Where megatron fell back to its own l2 norm (no apex, no TE), take l2_norm_copied_once. Idempotent."""
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm_copied_once
