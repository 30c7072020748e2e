"""The "test" device (npformer.runtime.testdevice): numpy memory held to CuPy's rules."""
import numpy as np
import pytest

from autograd import Tensor, backend
from npformer.runtime import testdevice


def test_test_device_keeps_cupys_rules():
    """What fails on CuPy fails on "test" too, so that code passing here runs on a GPU."""
    a = backend.to_device(np.ones(3), "test")
    host = np.ones(3)
    with pytest.raises(TypeError, match=r"host numpy array \(3,\) beside arrays of device 'test'"):
        a + host                                            # CuPy: Unsupported type numpy.ndarray
    with pytest.raises(TypeError, match="host numpy array"):
        testdevice.test_xp.concatenate([a, host])
    with pytest.raises(TypeError, match="host numpy array"):
        a[:] = host
    with pytest.raises(TypeError, match="numpy.argsort was called on an array of device 'test'"):
        np.argsort(a)
    with pytest.raises(RuntimeError, match="expected a gradient on device 'test', got one on 'cpu'"):
        Tensor(a, requires_grad=True).exp().backward(host)
    assert backend.device_of(a.sum()) == "test" and a.sum().shape == ()   # 0-d array, not a scalar
    assert backend.device_of(a * np.float32(2)) == "test"                # numpy scalars are fine
    np.testing.assert_array_equal(backend.as_numpy(a[np.array([0, 2])]), [1, 1])  # host indices too
    testdevice.test_xp.add.at(a, np.array([0, 0]), backend.to_device(np.ones(2), "test"))
    host_copy = backend.as_numpy(a)                         # copies, as a GPU transfer does
    host_copy[0] = -1
    assert float(a[0]) == 3.0
    moved = backend.to_device(host_copy, "test")
    host_copy[1] = -1
    assert float(moved[1]) == 1.0


def test_names_used_on_the_test_device_are_checked_against_cupy():
    from conftest import names_missing_in_cupy
    assert names_missing_in_cupy({"numpy.add.at", "numpy.random.Generator.random", "numpy.einsum"}) == []
    assert names_missing_in_cupy({"numpy.exp", "numpy.random.Generator.bit_generator", "numpy.nanpercentile_x"}) \
        == ["numpy.nanpercentile_x", "numpy.random.Generator.bit_generator"]
    testdevice.test_xp.exp(backend.to_device(np.ones(1), "test"))
    assert "numpy.exp" in testdevice._OnTestDevice.names_used
