"""theta's zipslice format plugin (entry point ``zipslice.formats``: ``theta``), kept tiny on purpose:
zipslice loads every registered spec when it looks a format up, and this module imports nothing but zipslice.
The work is in :mod:`theta.lazy`."""
from zipslice.formats import FormatSpec

FORMAT = FormatSpec("theta", "theta.lazy:ThetaCheckpoint", detect="theta.lazy:detect", opens="theta.lazy:open_spec")
