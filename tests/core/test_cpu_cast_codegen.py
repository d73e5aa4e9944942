"""The machine code of the ``cpu`` backend's streaming path (what no bit comparison can see)."""
import numpy as np
import pytest

from faircast_plugins import golden
from faircast_plugins.kernels import cpu_cast


@pytest.mark.skipif(not cpu_cast._X86, reason="reads x86 assembly")
def test_streaming_path_compiles_to_non_temporal_stores_and_a_fence():
    # a non-temporal store that LLVM dropped (or an unfenced one) would not change any bit, so read the machine code
    kernel = cpu_cast.numba.njit(nogil=True)(cpu_cast._stochastic_kernel_serial.py_func)  # uncached: inspectable
    kernel(np.zeros(64, np.uint16), np.zeros(64, np.uint32), cpu_cast.round_keys(golden.KEY_K[3]), 0, True)
    asm = kernel.inspect_asm(kernel.signatures[0])
    assert "movntdq" in asm and "sfence" in asm
    # negative control: the nearest kernel streams nothing
    nearest = cpu_cast.numba.njit(nogil=True)(cpu_cast._nearest_kernel_serial.py_func)
    nearest(np.zeros(64, np.uint16), np.zeros(64, np.uint32))
    assert "movntdq" not in nearest.inspect_asm(nearest.signatures[0])
