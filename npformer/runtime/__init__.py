"""npformer's runtime: what runs beside the autograd core to make it fast and to check device code.

- `threads`: intra-op threads on the CPU (`set_num_threads`) and the row blocks ops split into;
- `kernels`: kernel tables, one reference per fused computation and faster ones per device;
- `random`: the Philox dropout stream and the per-device generators (`manual_seed`);
- `lookahead`: the next pass's dropout masks drawn ahead in the thread pool;
- `deferred`: checks of device data, reported at the next host read;
- `graphs`: the graph capture in progress in this thread (`npformer.cuda.graphed`);
- `host_memory`: glibc's malloc thresholds, so freed arrays' pages are reused;
- `testdevice`: the "test" device, numpy held to CuPy's rules.

The core (`autograd/`) imports none of it. The runtime plugs in here, once, when npformer is
imported (npformer/__init__.py imports this package first): it registers its functions as the
core's hooks (`autograd.hooks`), the test device registers itself with the backend switch
(`autograd.backend.register_device`), and freed memory is kept (`host_memory`, unless
NPFORMER_HOST_MEMORY=release). This package imports only autograd and itself.
"""
from autograd import hooks

from . import deferred, graphs, host_memory, kernels, lookahead, random, testdevice, threads

hooks.backward_started.append(lookahead.end_pass)  # the forward pass's dropout masks predict the next's
hooks.host_read.append(deferred.raise_pending)      # reading a value reports the deferred device checks
host_memory.keep_freed_memory()                     # freed arrays' pages are reused (see host_memory)

__all__ = ["deferred", "graphs", "host_memory", "kernels", "lookahead", "random", "testdevice", "threads"]
