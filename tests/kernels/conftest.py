"""Every kernel test compares afd's native kernel to its torch twin: where the kernel did not build, the
native side would silently be the torch path again, and the comparison would be of a path with itself."""

import pytest

from afd.kernels import ops as native_ops


@pytest.fixture(autouse=True)
def the_kernels_are_built():
    assert native_ops() is not None, "afd/kernels did not build here (see the warning in the log): nothing native to compare"
