# _sources.py - what Unit.grad_accumulate accepts as a grad: an array of any framework, or an address.
"""An array of the host's framework as (address, fsdp_dtype_t code, element count), without a copy: the
source that fsdp_grad_accumulate reads on the unit's device. The array must be dense row-major (C order)
and stay alive until the add has run (on a GPU: until the stream it was queued on is synchronized)."""
import numpy as np

CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # fsdp_dtype_t
_ALIASES = {"fp32": "float32", "f4": "float32", "<f4": "float32", "bf16": "bfloat16", "fp16": "float16",
            "f2": "float16", "<f2": "float16", "half": "float16", "float": "float32"}


def dtype_name(dt):
    """'float32', 'bfloat16' or 'float16' for a dtype of numpy, ml_dtypes, JAX or torch, or its name; None
    for any other dtype."""
    name = str(dt).rsplit(".", 1)[-1]  # torch.bfloat16 -> bfloat16
    name = _ALIASES.get(name, name)
    return name if name in CODES else None


def _check_dtype(name, dtype, raw16, what):
    """The dtype name of the source: its own, or dtype= where the array holds raw 16-bit values."""
    if dtype is not None:
        want = dtype_name(dtype)
        if want is None:
            raise ValueError(f"{what}: dtype={dtype!r} is none of float32, bfloat16, float16")
        if raw16 and want != "float32":
            return want
        if name != want:
            raise ValueError(f"{what}: dtype={dtype!r} but the array holds {name}")
        return want
    if name is None:
        raise ValueError(f"{what}: the array's dtype is none of float32, bfloat16, float16 (raw 16-bit values: "
                         f"pass dtype='bfloat16' or 'float16')")
    return name


def grad_source(src, dtype, what):
    """(address, dtype code, element count or None for an address) of `src`: a torch tensor, a JAX array, a
    numpy array, an array with __cuda_array_interface__ (CuPy, Numba) or an int address with dtype=."""
    if isinstance(src, bool):
        raise TypeError(f"{what}: src={src!r} is not an array")
    if isinstance(src, int):
        if dtype is None:
            raise TypeError(f"{what}: an address needs dtype= (float32, bfloat16 or float16)")
        name = _check_dtype(None, dtype, True, what)
        return src, CODES[name], None
    if hasattr(src, "data_ptr") and hasattr(src, "is_contiguous"):  # torch
        if not src.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous())")
        name = _check_dtype(dtype_name(src.dtype), dtype, False, what)
        return src.data_ptr(), CODES[name], src.numel()
    if hasattr(src, "unsafe_buffer_pointer"):  # a JAX array: dense, row-major, on one device
        name = _check_dtype(dtype_name(src.dtype), dtype, False, what)
        return src.unsafe_buffer_pointer(), CODES[name], int(src.size)
    if isinstance(src, np.ndarray):
        if not src.flags.c_contiguous:
            raise ValueError(f"{what}: the array is not C-contiguous (np.ascontiguousarray)")
        raw16 = src.dtype in (np.uint16, np.int16)
        name = _check_dtype(None if raw16 else dtype_name(src.dtype), dtype, raw16, what)
        return src.ctypes.data, CODES[name], int(src.size)
    cai = getattr(src, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        name = dtype_name(cai["typestr"])
        itemsize = int(cai["typestr"][2:]) if len(cai["typestr"]) > 2 else 0
        if strides is not None:
            dense, step = [], itemsize
            for d in reversed(shape):
                dense.insert(0, step)
                step *= d
            if tuple(strides) != tuple(dense) and int(np.prod(shape)) > 1:
                raise ValueError(f"{what}: the array is not C-contiguous")
        name = _check_dtype(name, dtype, name is None and itemsize == 2, what)
        return int(cai["data"][0]), CODES[name], int(np.prod(shape)) if shape else 1
    raise TypeError(f"{what}: src of type {type(src).__name__} is no array this binding reads (a torch tensor, a "
                    f"JAX array, a numpy array, an array with __cuda_array_interface__, or an int address with dtype=)")
