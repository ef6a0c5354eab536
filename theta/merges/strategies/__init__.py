"""The built-in merge strategies, one module per family, registered as ``theta.merges`` entry points exactly as
a third party's are (pyproject.toml): :mod:`.pick` (ours, theirs, ancestor), :mod:`.linear` (average,
task-arithmetic), :mod:`.sparsified` (ties, dare), :mod:`.slerp`; their base classes in :mod:`.base`
(docs/extending.md)."""
