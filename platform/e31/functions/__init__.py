"""Python-native calls on the pool: `@e31.function` (`decorator`), what a function needs of
the caller's modules (`modules`), the pickling of a call (`calls`), the check of its versions
against the workers' (`versions`), its bundles (`uploads`) and the values of a `.map`
(`mapping`). docs/notebooks.md.

Owns: turning a Python call into the platform's own objects (bundles, jobs, arrays) through
the client, and the values back.

May import: the client and the core of `e31`, cloudpickle. Never the store, the edge, the API,
the scheduler or `e31_worker`: like any user program it talks HTTP through `e31.client`.
"""

from e31.functions.decorator import Function, function

__all__ = ["Function", "function"]
