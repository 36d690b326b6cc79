"""Launch a ``@triton.jit`` kernel through the C launcher Triton built for it, once it is compiled.

``kernel[grid](*args, **meta)`` binds arguments, computes Triton's specialisation key and looks up its cache in
Python on every call: ~50 µs of host time on the H100's host, more than a small RMSNorm takes on the GPU.
:func:`launch` does that once per caller-chosen ``key`` (which must determine everything Triton specialises on:
the scalar arguments, the tensors' dtypes, the meta-parameters, the grid and the device; tensors are 32-byte
aligned by ``custom_ops.kernel_ready``) and afterwards calls the compiled kernel's launcher directly, on torch's
current stream. Under Triton's interpreter, with launch hooks set, or for kernels that need scratch memory it
always takes Triton's own path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from triton import knobs

_DIRECT: dict[tuple, Callable | None] = {}
_CAPPED: dict[tuple, int | None] = {}  # per key: the register cap ``launch`` compiled the kernel under, if any


def _direct(compiled, kernel, grid: tuple[int, ...], args: Sequence, meta: dict, device: int) -> Callable | None:
    """``go(args)`` launching ``compiled`` with the constexpr values of ``meta`` appended; None if unsupported.
    Tensors go in as their data pointers, which Triton's launcher takes as they are (for a tensor it asks the
    driver to check the pointer, ~1 µs each; ours are CUDA tensors already)."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
        return None
    tail = tuple(meta[name] for name in kernel.arg_names[len(args):])
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    launch, function, packed = run.launch, compiled.function, compiled.packed_metadata
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    gx, gy, gz = (*grid, 1, 1)[:3]
    stream_of = torch._C._cuda_getCurrentRawStream

    def go(args: Sequence) -> None:
        values = list(args)
        for i in tensors:
            values[i] = values[i].data_ptr()
        launch(gx, gy, gz, stream_of(device), function, coop, pdl, None, None, packed, None, None, None, *values,
               *tail)

    return go


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(x: torch.Tensor) -> int:
    """SMs of the GPU holding ``x`` (cached per device; 2 off a GPU, for the interpreter's small grids)."""
    return _num_sms(x.get_device()) if x.is_cuda else 2


@functools.lru_cache(maxsize=None)
def _model(device_index: int) -> str:
    from pallas_norm.backend import model_slug

    return model_slug(torch.cuda.get_device_name(device_index))


def gpu_model(x: torch.Tensor) -> str:
    """The model of the GPU holding ``x`` (``pallas_norm.backend.model_slug``, e.g. "h200"; "" off a GPU): the key
    of the Pallas tables' per-model entries the Triton reference reads too (``ffi_tables.two_pass_tile``)."""
    return _model(x.get_device()) if x.is_cuda else ""


def _hooks_set() -> bool:
    """Whether a launch hook is set (a profiler's, e.g.): Triton's own path calls them, the direct one does not.
    Triton >= 3.4 keeps them in ``HookChain`` objects, which are set when their ``calls`` list is not empty."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)


def registers(kernel, grid: tuple[int, ...], args: Sequence, meta: dict) -> int:
    """Registers per thread of ``kernel`` compiled for ``kernel[grid](*args, **meta)`` (compiled without launching;
    Triton's cache keeps it for that launch)."""
    compiled = kernel.warmup(*args, grid=grid, **meta)
    compiled._init_handles()  # loads the module: the driver reports its registers
    return compiled.n_regs


def fitted_cap(cap: int | None, registers_taken: Callable[[], int]) -> int | None:
    """``cap`` where the kernel takes more registers per thread than it (``registers_taken()``, asked only then),
    else None: ``launch``'s ``max_registers`` rule (``bench.offline_triton`` applies it too)."""
    return cap if cap is not None and registers_taken() > cap else None


def launch(key: tuple, kernel, grid: tuple[int, ...], args: Sequence, meta: Callable[[], dict], *,
           interpret: bool) -> None:
    """``kernel[grid](*args, **meta())``; after the first call for ``key`` (on a CUDA device), its launcher alone
    (``meta`` is a function so that the launches that need no meta-parameters do not build them).
    ``meta()`` may name ``max_registers`` (not a Triton option; None: no limit): where the kernel as compiled takes
    more registers per thread than that, it is compiled again with that cap (Triton's ``maxnreg``), decided once per
    ``key`` (``fitted_cap``); a kernel within it keeps the code it was given."""
    go = None if interpret else _DIRECT.get(key)
    if go is not None and not _hooks_set():
        go(args)
        return
    meta = meta()
    cap = meta.pop("max_registers", None)
    if cap is not None and not interpret:
        if key not in _CAPPED:
            _CAPPED[key] = fitted_cap(cap, lambda: registers(kernel, grid, args, meta))
        if _CAPPED[key] is not None:
            meta = {**meta, "maxnreg": _CAPPED[key]}
    compiled = kernel[grid](*args, **meta)
    if not interpret and key not in _DIRECT:
        _DIRECT[key] = _direct(compiled, kernel, grid, args, meta, torch.cuda.current_device())
