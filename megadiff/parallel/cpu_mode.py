"""megatron-core on a machine without CUDA (development, the CPU demo, CI).

megatron-core 0.16.1 assumes CUDA in seven places: `torch.cuda.current_device()`
as a device, stream-capture checks, the CUDA RNG tracker, hard-coded
device="cuda" / `.cuda()` in schedules and optimizers, `torch.cuda.synchronize()`,
`Tensor.type()` asserting 'torch.cuda.FloatTensor', and `pin_memory=True`
(context-parallel RoPE). `enable()` redirects each of them to the
CPU. It refuses to run where CUDA exists, so GPU runs always take megatron's
real CUDA paths untouched.
"""
from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

_mode: "_CudaToCpu | None" = None


def _to_cpu_device(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and makes `.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # page-locked host memory only exists with an accelerator
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers assert CUDA tensor type names
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def enable() -> None:
    """Idempotent. Call before building megatron models, once per process."""
    global _mode
    if _mode is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron CPU mode must not be enabled on a machine with CUDA")
    import megatron.core.tensor_parallel.random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed calls these itself; seeding the default generator does not recurse
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _mode = _CudaToCpu()
    _mode.__enter__()
