"""theta's zipslice format plugin (entry point ``zipslice.formats``: ``theta``), kept tiny on purpose:
zipslice loads every registered spec when it looks a format up, and this module imports nothing but zipslice.
The work is in :mod:`theta.model.lazy`."""
from zipslice.formats import FormatSpec

FORMAT = FormatSpec("theta", "theta.model.lazy:ThetaCheckpoint", detect="theta.model.lazy:detect", opens="theta.model.lazy:open_spec")
