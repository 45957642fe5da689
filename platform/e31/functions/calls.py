"""Pickling a call: the function's envelope once, each item's arguments apart, and a refusal
that names the argument when something will not travel.

A function defined in `__main__` (a script, a notebook cell) is pickled by value with the
globals it uses (cloudpickle); one of an importable module by reference, its module then
travelling in the code bundle (`e31.functions.modules`). Everything is pickled here, before
anything is uploaded or stored, so a bad argument costs the caller nothing but the error.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle

from e31.core.errors import FunctionError
from e31.core.functioncalls import facts

PICKLE_PROTOCOL = 5    # the newest every supported Python reads (3.8+): out-of-band buffers


def envelope(fn: Any, shared: Mapping[str, Any], distributions: frozenset[str]) -> bytes:
    """The function's entry: a plain pickle of builtins holding the caller's versions (read by
    the worker before it unpickles anything of the user's), the function and `shared`, the
    keyword arguments every item of a `.map` gets (uploaded once)."""
    on_gpu = gpu_values(fn)
    if on_gpu:
        raise FunctionError(f"{_name(fn)} refers to {on_gpu[0]}, which lives on a GPU of this "
                            "machine; a job cannot reach it. Move it to the CPU (.cpu()) or "
                            "build it inside the function")
    function = _dumps(fn, f"the function {_name(fn)}")
    kwargs = _dumps(dict(shared), "the shared keyword arguments", values=shared)
    return pickle.dumps({"facts": facts(distributions), "function": function, "kwargs": kwargs},
                        protocol=PICKLE_PROTOCOL)


def call_bytes(args: Sequence[Any], kwargs: Mapping[str, Any], *, where: str = "") -> bytes:
    """One item's pickled `(args, kwargs)`; a `FunctionError` naming the argument (and `where`:
    which item of a map) that does not pickle or lives on a GPU."""
    named = {f"argument {i}{where}": a for i, a in enumerate(args)}
    named.update({f"argument {k!r}{where}": v for k, v in kwargs.items()})
    for label, value in named.items():
        if _is_on_gpu(value):
            raise FunctionError(f"{label} is a tensor on {value.device}; move it to the CPU "
                                "(.cpu()) first: a job cannot reach this machine's GPU")
    return _dumps((tuple(args), dict(kwargs)), f"the arguments{where}", values=named)


def calls_file(calls: Sequence[bytes]) -> bytes:
    """The items' calls as one entry (`args.pkl`): a plain pickled list of bytes."""
    return pickle.dumps(list(calls), protocol=PICKLE_PROTOCOL)


def _dumps(obj: Any, what: str, *, values: Mapping[str, Any] | None = None) -> bytes:
    try:
        return bytes(cloudpickle.dumps(obj, protocol=PICKLE_PROTOCOL))
    except Exception as exc:  # pickling raises TypeError, PicklingError, anything
        culprit = _culprit(values or {})
        raise FunctionError(f"{culprit or what} cannot be pickled: "
                            f"{type(exc).__name__}: {exc}") from exc


def _culprit(values: Mapping[str, Any]) -> str | None:
    """Which of `values` (label -> value) does not pickle, with its type."""
    for label, value in values.items():
        try:
            cloudpickle.dumps(value, protocol=PICKLE_PROTOCOL)
        except Exception:  # noqa: BLE001 - as in _dumps
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            label, _, where = label.partition(" of ")
            return f"{label} ({kind})" + (f" of {where}" if where else "")
    return None


def gpu_values(fn: Any) -> list[str]:
    """The names of the values on a GPU that `fn` closes over or reads from its globals."""
    found = []
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, cells, strict=False):
        try:
            if _is_on_gpu(cell.cell_contents):
                found.append(f"the variable {name!r}")
        except ValueError:    # an empty cell
            continue
    glob = getattr(fn, "__globals__", {})
    for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
        if name in glob and _is_on_gpu(glob[name]):
            found.append(f"the global {name!r}")
    return found


def _is_on_gpu(value: Any) -> bool:
    """A torch tensor (or module parameter) on CUDA, told without importing torch."""
    return getattr(value, "is_cuda", False) is True


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn)))
