"""The vocabulary every process shares: specs, states, errors, keys, record types, size
classes, limits, metric names, the clock. Imports nothing else of e31."""
