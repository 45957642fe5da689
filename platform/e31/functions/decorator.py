"""`@e31.function`: a Python function that runs on the pool as ordinary jobs.

`Function` is an adapter over the client, not a second system (STYLE.md rule 13): a call is a
job of the `function` workload submitted with `Client.submit`, a `.map` one array submitted
with `Client.submit_many`, its code and arguments bundles sent through the client's bundle
path. Whatever a spec may say (`gpus`, `timeout_s`, `retries`, `python`, `env`, `secrets`,
`inputs`, `network`, …) the decorator takes as keywords; `gpus` and the other `resources`
fields may be given at the top, `retries` as a number. Unlike a spec, a function asks for no
GPU unless told (`gpus=1`). docs/notebooks.md.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from e31.core.functioncalls import ARGS_INPUT, FUNCTION_ENTRYPOINT, FUNCTION_INPUT, facts
from e31.core.spec import JobSpec
from e31.functions import calls as pickling
from e31.functions import versions
from e31.functions.mapping import Order, results
from e31.functions.modules import needs_of
from e31.functions.uploads import Sending, send_calls, send_code

if TYPE_CHECKING:
    from e31.client.bundle import Sent
    from e31.client.client import Client
    from e31.client.handles import ArrayHandle, JobHandle

P = ParamSpec("P")
R = TypeVar("R")
RESOURCE_FIELDS = ("gpus", "gpu_mem_gb", "size_class", "mem_gb", "disk_gb", "on_oom")
CLIENT_FIELDS = ("workdir",)       # the client packs it; no spec field of the API's
RESERVED_INPUTS = (FUNCTION_INPUT, ARGS_INPUT)
ARRAY_ITEMS_MAX = 10_000           # the API's most items of one array (e31.ops.sweep)


def spec_of(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The spec fields of a decorator's keywords: `resources` fields gathered, `retries=N`
    as `{"max": N}`, no GPU unless asked; validated now, so a typo fails at the decorator."""
    spec = {k: v for k, v in fields.items() if k not in RESOURCE_FIELDS}
    resources = {"gpus": 0, **dict(spec.pop("resources", None) or {}),
                 **{k: fields[k] for k in RESOURCE_FIELDS if k in fields}}
    spec["resources"] = resources
    if isinstance(spec.get("retries"), int):
        spec["retries"] = {"max": spec["retries"]}
    taken = [n for n in RESERVED_INPUTS if n in (spec.get("inputs") or {})]
    if taken:
        from e31.core.errors import SpecError
        raise SpecError.one(f"inputs.{taken[0]}", "this input name is the call's own")
    JobSpec.parse({k: v for k, v in spec.items() if k not in CLIENT_FIELDS}
                  | {"entrypoint": FUNCTION_ENTRYPOINT})
    return spec


class _Call(Generic[P, R]):
    """A method that also has `.aio`: the same call in a thread, awaited, so that a notebook's
    event loop keeps running while the job does."""

    def __init__(self, call: Callable[P, R]) -> None:
        self._call = call

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call(*args, **kwargs)

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(self._call, *args, **kwargs)


class _MapCall(Generic[P]):
    """`.map` and `.starmap`: an iterator of values, and `.aio` an async one."""

    def __init__(self, call: Callable[P, Iterator[Any]]) -> None:
        self._call = call

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Any]:
        return self._call(*args, **kwargs)

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Any]:
        it = await asyncio.to_thread(self._call, *args, **kwargs)
        done = object()
        while (value := await asyncio.to_thread(next, it, done)) is not done:
            yield value


class Function(Generic[P, R]):
    """A function that runs on the pool: `.remote`, `.submit`, `.map`, `.starmap`, `.local`."""

    def __init__(self, fn: Callable[P, R], spec: Mapping[str, Any], *,
                 client: Client | None = None) -> None:
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self._fn = fn
        self._spec = dict(spec)
        self._client = client
        self.last_sent: list[Sent] = []       # the bundles the last call needed
        self.last_array: ArrayHandle | None = None
        self.remote = _Call(self._remote)
        self.map = _MapCall(self._map)
        self.starmap = _MapCall(self._starmap)

    def __getstate__(self) -> dict[str, Any]:
        # A decorated function that another one calls travels without the caller's client.
        return {"fn": self._fn, "spec": self._spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"], state["spec"])   # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<e31.function {getattr(self._fn, '__qualname__', self._fn)!r}>"

    @property
    def client(self) -> Client:
        """The client it submits with: the one given, else `Client()` (E31_URL and E31_TOKEN,
        or the profile of `e31 up`), built at the first call."""
        if self._client is None:
            from e31.client.client import Client
            self._client = Client()
        return self._client

    def using(self, client: Client) -> Function[P, R]:
        """The same function submitting with `client`."""
        return Function(self._fn, self._spec, client=client)

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call it here, in this process: for tests and for trying it out."""
        return self._fn(*args, **kwargs)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """Run one call as a job; its handle's `result()` is the function's value."""
        sending = self._send([pickling.call_bytes(args, kwargs)], {})
        body = self._common(sending) | self._item(sending, 0)
        if self._spec.get("name") is not None:
            body["name"] = self._spec["name"]
        handle = self.client.submit(body)
        self.last_sent = sending.sent + self.client.last_bundles
        return handle

    def _remote(self, *args: P.args, **kwargs: P.kwargs) -> R:
        from e31.core.errors import JobFailed
        handle = self.submit(*args, **kwargs)
        try:
            status = handle.wait()
        except JobFailed as exc:
            status = exc.status
        value: R = handle.value(status)
        return value

    def _map(self, *iterables: Iterable[Any], kwargs: Mapping[str, Any] | None = None,
             order: Order = "input", return_exceptions: bool = False,
             progress: bool | None = None) -> Iterator[Any]:
        """One array for every item (`zip` of the iterables); `kwargs`, shared by every item,
        are uploaded once. The values come as the module `mapping` says."""
        return self._starmap(zip(*iterables, strict=True), kwargs=kwargs, order=order,
                             return_exceptions=return_exceptions, progress=progress)

    def _starmap(self, iterable: Iterable[Iterable[Any]], *,
                 kwargs: Mapping[str, Any] | None = None, order: Order = "input",
                 return_exceptions: bool = False, progress: bool | None = None
                 ) -> Iterator[Any]:
        """As `map`, each item a tuple of positional arguments."""
        blobs = [pickling.call_bytes(tuple(args), {}, where=f" of item {i}")
                 for i, args in enumerate(iterable)]
        if not blobs:
            return iter(())
        sending = self._send(blobs, kwargs or {})
        starts = range(0, len(blobs), ARRAY_ITEMS_MAX)
        first = self._submit_array(sending, 0, len(blobs))
        self.last_sent = sending.sent + self.client.last_bundles

        def chained() -> Iterator[Any]:
            # Each further array is submitted once the one before has given its values: a
            # tenant may hold at most tenant_max_queued (10,000) queued jobs at once.
            for start in starts:
                array = first if start == 0 else self._submit_array(sending, start, len(blobs))
                yield from results(array, order=order, return_exceptions=return_exceptions,
                                   progress=progress)

        return chained()

    def _submit_array(self, sending: Sending, start: int, total: int) -> ArrayHandle:
        """Items `start` to at most ARRAY_ITEMS_MAX further as one array."""
        items = [self._item(sending, i) for i in range(start, min(start + ARRAY_ITEMS_MAX,
                                                                  total))]
        self.last_array = self.client.submit_many(items, name=self._spec.get("name"),
                                                  **self._common(sending))
        return self.last_array

    def _send(self, blobs: list[bytes], shared: Mapping[str, Any]) -> Sending:
        """Pickle the function, check the versions against the workers' and send the code and
        the call: each refusal comes before anything is uploaded or stored."""
        needs = needs_of(self._fn)
        if needs.fileless:
            from e31.core.errors import FunctionError
            raise FunctionError(f"module {sorted(needs.fileless)[0]!r}, which the function "
                                "uses, has no file: the worker cannot import it. Put it in a "
                                "file beside your script, or define what it holds in the "
                                "function")
        envelope = pickling.envelope(self._fn, shared, needs.distributions)
        versions.check(self.client, self._spec, facts(needs.distributions),
                       modules=needs.modules, unpackaged=needs.unpackaged)
        sending = Sending()
        if not any(k in self._spec for k in ("code", "workdir")):
            send_code(self.client, needs, sending)
        send_calls(self.client, envelope, blobs, sending)
        return sending

    def _common(self, sending: Sending) -> dict[str, Any]:
        spec = {k: v for k, v in self._spec.items() if k not in ("inputs", "name")}
        spec["entrypoint"] = FUNCTION_ENTRYPOINT
        if sending.code is not None:
            spec["code"] = sending.code
        return spec

    def _item(self, sending: Sending, index: int) -> dict[str, Any]:
        source, item = sending.item_sources[index]
        inputs = {**(self._spec.get("inputs") or {}), FUNCTION_INPUT: sending.function_source,
                  ARGS_INPUT: source}
        body: dict[str, Any] = {"params": {"item": item}, "inputs": inputs}
        return body


def function(fn: Callable[P, R] | None = None, /, *, client: Client | None = None,
             **spec: Any) -> Any:
    """`@e31.function` or `@e31.function(gpus=1, timeout_s=600, …)`: see `Function`."""
    fields = spec_of(spec)

    def wrap(f: Callable[P, R]) -> Function[P, R]:
        return Function(f, fields, client=client)

    return wrap(fn) if fn is not None else wrap
