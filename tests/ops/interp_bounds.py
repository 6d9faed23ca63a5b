"""A memory-bounds checker for Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter executes tl.load / tl.store / atomics as numpy reads and writes at raw addresses and does not
fault on an address outside every tensor (it reads or writes whatever lies there), so a kernel that would hit
"an illegal memory access" on a GPU passes on the CPU. Inside `bounds_checked()`, every launch records the
byte range of each tensor argument ([data_ptr, data_ptr + span of the view)), and every memory operation checks
that each lane it performs (mask true; masked-off lanes are not issued on a GPU) lies wholly inside one of
those ranges. A violating lane is not performed (the load yields 0, the store / atomic is dropped), the
violation is recorded with the kernel, program id, operation, nearest tensor argument, offending element
offsets and the source line (with its @triton.jit callers), and leaving the block raises AssertionError naming
the first violation of each distinct source line.

    with bounds_checked():
        kernel(...)

`check_masked=True` also checks masked-off lanes (reported separately as "masked"; harmless on a GPU unless
the mask is wrong). `per_storage=True` allows the whole storage behind a view instead of the view's span.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

import numpy as np

_HERE = os.path.abspath(__file__)
_TRITON = None          # the triton package folder (frames inside it are not reported)


def _triton_dir() -> str:
    global _TRITON
    if _TRITON is None:
        import triton

        _TRITON = os.path.dirname(os.path.abspath(triton.__file__)) + os.sep
    return _TRITON


@dataclasses.dataclass
class _Range:
    name: str
    start: int
    end: int            # exclusive, bytes
    itemsize: int
    shape: tuple


@dataclasses.dataclass
class Violation:
    kernel: str
    program: tuple
    op: str              # load / store / atomic_* / masked load ...
    lanes: int           # offending lanes of the operation
    total: int           # lanes of the operation (performed ones)
    nearest: str         # the nearest tensor argument and the offending offsets relative to it
    where: list          # source frames, innermost first

    def __str__(self) -> str:
        frames = "\n".join(f"      {f}" for f in self.where)
        return (f"{self.op} out of bounds in {self.kernel} program {self.program}: {self.lanes} of {self.total} "
                f"lanes\n    {self.nearest}\n    at\n{frames}")


def _span(tensor, per_storage: bool):
    import torch

    base = getattr(tensor, "base", tensor) if not isinstance(tensor, torch.Tensor) else tensor
    if not isinstance(base, torch.Tensor):
        return None
    itemsize = base.element_size()
    if per_storage:
        storage = base.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes(), itemsize
    start = base.data_ptr()
    if base.numel() == 0:
        return start, start, itemsize
    last = sum((size - 1) * stride for size, stride in zip(base.shape, base.stride()))
    return start, start + (last + 1) * itemsize, itemsize


class BoundsChecker:
    def __init__(self, check_masked: bool = False, per_storage: bool = False, max_records: int = 1000):
        self.check_masked = check_masked
        self.per_storage = per_storage
        self.max_records = max_records
        self.violations: list[Violation] = []
        self.launches = 0
        self.checked_ops = 0
        self._ranges: list[_Range] | None = None
        self._kernel = "?"

    # ------------------------------------------------------------------ launch bookkeeping
    def _record_args(self, fn, arg_names, args_hst, kwargs_hst):
        ranges = []
        named = list(zip(arg_names, args_hst)) + list(kwargs_hst.items())
        for name, arg in named:
            items = [(name, arg)] if not isinstance(arg, tuple) else [(f"{name}[{i}]", a) for i, a in enumerate(arg)]
            for item_name, item in items:
                if not hasattr(item, "data_ptr"):
                    continue
                span = _span(item, self.per_storage)
                if span is not None:
                    ranges.append(_Range(item_name, span[0], span[1], span[2], tuple(getattr(item, "shape", ()))))
        self._ranges = ranges
        self._kernel = getattr(fn, "__name__", "?")
        self.launches += 1

    # ------------------------------------------------------------------ checks
    def _where(self) -> list[str]:
        frames = []
        for frame in reversed(traceback.extract_stack()):
            path = os.path.abspath(frame.filename)
            if path == _HERE or path.startswith(_triton_dir()) or f"{os.sep}numpy{os.sep}" in path:
                continue
            if frame.name in ("_call_impl", "_wrapped_call_impl"):
                continue
            frames.append(f"{os.path.relpath(path)}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
            if len(frames) >= 6:
                break
        return frames

    def _describe(self, addrs: np.ndarray, itemsize: int) -> str:
        """The tensor argument nearest to the offending addresses, with their offsets in its elements."""
        lo = int(addrs.min())
        best, best_dist = None, None
        for r in self._ranges:
            dist = 0 if r.start <= lo < r.end else (lo - r.end if lo >= r.end else r.start - lo)
            if best is None or dist < best_dist:
                best, best_dist = r, dist
        if best is None:
            return f"no tensor arguments; addresses {addrs[:8].tolist()}"
        offs = (addrs.astype(np.int64) - np.int64(best.start)) // best.itemsize
        uniq = np.unique(offs)
        size = (best.end - best.start) // best.itemsize
        shown = uniq[:8].tolist() + (["..."] if uniq.size > 8 else [])
        return (f"nearest argument `{best.name}` {list(best.shape)} ({size} elements of {best.itemsize} B), "
                f"offending element offsets {shown} (access {itemsize} B wide)")

    def check(self, op: str, ptrs, mask, itemsize: int):
        """The lanes of `mask` that may be performed (the rest are dropped by the caller); records violations."""
        if self._ranges is None:
            return mask
        self.checked_ops += 1
        addrs = np.asarray(ptrs, dtype=np.uint64)
        live = np.broadcast_to(np.asarray(mask, dtype=bool), addrs.shape) if mask is not None else \
            np.ones(addrs.shape, dtype=bool)
        inside = np.zeros(addrs.shape, dtype=bool)
        a = addrs.astype(np.uint64)
        for r in self._ranges:
            if r.end > r.start:
                inside |= (a >= np.uint64(r.start)) & (a + np.uint64(itemsize) <= np.uint64(r.end))
        bad = live & ~inside
        if bad.any():
            self._add(op, a[bad], int(bad.sum()), int(live.sum()), itemsize)
        if self.check_masked:
            bad_masked = ~live & ~inside
            if bad_masked.any():
                self._add(f"masked-off {op}", a[bad_masked], int(bad_masked.sum()), int((~live).sum()), itemsize)
        return live & inside

    def _add(self, op, addrs, lanes, total, itemsize):
        if len(self.violations) >= self.max_records:
            return
        from triton.runtime.interpreter import interpreter_builder

        program = tuple(int(i) for i in getattr(interpreter_builder, "grid_idx", (0, 0, 0)))
        self.violations.append(Violation(self._kernel, program, op, lanes, total, self._describe(addrs, itemsize),
                                         self._where()))

    # ------------------------------------------------------------------ report
    def distinct(self) -> list[Violation]:
        seen, out = set(), []
        for v in self.violations:
            key = (v.op, v.where[0] if v.where else "")
            if key not in seen:
                seen.add(key)
                out.append(v)
        return out

    def report(self) -> str:
        distinct = self.distinct()
        head = (f"{len(self.violations)} out-of-bounds memory operation(s), {len(distinct)} distinct site(s), "
                f"in {self.launches} launch(es):")
        return "\n".join([head] + [str(v) for v in distinct])

    def assert_clean(self):
        if self.violations:
            raise AssertionError(self.report())


def _patch(checker: BoundsChecker):
    """Patches the interpreter's launch and memory operations; returns the undo function."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError("bounds_checked() needs Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    executor = interp.GridExecutor
    saved_builder = {name: builder.__dict__.get(name) for name in
                     ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    saved_init = executor._init_args_hst

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        checker._record_args(self.fn, self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    orig_load = type(builder).create_masked_load.__get__(builder)
    orig_store = type(builder).create_masked_store.__get__(builder)
    orig_rmw = type(builder).create_atomic_rmw.__get__(builder)
    orig_cas = type(builder).create_atomic_cas.__get__(builder)

    def itemsize_of(ptrs):
        return max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        keep = checker.check("load", ptrs.data, mask.data, itemsize_of(ptrs))
        if not keep.all() or keep.shape != np.shape(mask.data):
            mask = interp.TensorHandle(np.ascontiguousarray(keep), mask.dtype)
        return orig_load(ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_policy):
        keep = checker.check("store", ptrs.data, mask.data, itemsize_of(ptrs))
        if not keep.all() or keep.shape != np.shape(mask.data):
            mask = interp.TensorHandle(np.ascontiguousarray(keep), mask.dtype)
        return orig_store(ptrs, value, mask, cache_policy)

    def atomic_rmw(rmw_op, ptr, val, mask, sem, scope):
        keep = checker.check("atomic_rmw", ptr.data, mask.data, itemsize_of(ptr))
        if not keep.all() or keep.shape != np.shape(mask.data):
            mask = interp.TensorHandle(np.ascontiguousarray(keep), mask.dtype)
        return orig_rmw(rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(ptr, cmp, val, sem, scope):
        keep = checker.check("atomic_cas", ptr.data, None, itemsize_of(ptr))
        if not keep.all():
            raise AssertionError(checker.report())              # no mask to drop lanes with: stop here
        return orig_cas(ptr, cmp, val, sem, scope)

    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    builder.create_atomic_cas = atomic_cas
    executor._init_args_hst = init_args_hst

    def undo():
        executor._init_args_hst = saved_init
        for name, value in saved_builder.items():
            if value is None:
                builder.__dict__.pop(name, None)
            else:
                setattr(builder, name, value)

    return undo


@contextlib.contextmanager
def bounds_checked(check_masked: bool = False, per_storage: bool = False, raise_on_exit: bool = True):
    """Checks every interpreted load / store / atomic in the block (see the module docstring); yields the
    BoundsChecker (its .violations, .report()); raises AssertionError on leaving if any lane was out of bounds."""
    checker = BoundsChecker(check_masked=check_masked, per_storage=per_storage)
    undo = _patch(checker)
    try:
        yield checker
    finally:
        undo()
    if raise_on_exit:
        checker.assert_clean()
