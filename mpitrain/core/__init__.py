"""The core: options, model, optimizer, data, wire codecs, the array backend, guards.

Arrays and numbers only. Nothing here imports MPI or any other part of mpitrain (an
import-linter contract in pyproject.toml says so and tests/test_structure.py runs it), so a
model, an optimizer or a codec can be read, tested and reused without a job around it.
"""
