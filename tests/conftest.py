"""Test harness: interpreter on CPU, full sizes on a GPU.

Importing kvforge.kernels first turns on TRITON_INTERPRET when torch sees no CUDA device, before any kernel
is decorated. Tests marked ``gpu`` skip with a reason on such machines.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvforge.kernels  # noqa: F401  (must precede every kernel import)
from kvforge.kernels._runtime import interpreting, kernel_device

try:
    from hypothesis import HealthCheck, settings

    # "ci" (the default, and what the README's test command runs) is derandomised: the same examples every
    # run, so a fresh clone passes or fails the same way. "dev" (HYPOTHESIS_PROFILE=dev) explores new ones.
    settings.register_profile(
        "ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow], derandomize=True
    )
    settings.register_profile("dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test extra; property tests import it themselves
    pass

HAS_GPU = torch.cuda.is_available() and not interpreting()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/run_gpu_suite.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tensors live: the GPU when there is one, else the CPU (interpreter)."""
    return kernel_device()


@pytest.fixture
def full_sizes() -> bool:
    """True on a GPU: tests scale their shapes up; the interpreter keeps them small."""
    return HAS_GPU


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A fresh, test-specific but varying seed: new random data each run, reported on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture(params=["fast", "aiohttp"])
def http_layer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The router's HTTP layer that ``tests.service_harness.fleet`` serves with, one run per layer."""
    from tests import service_harness

    monkeypatch.setattr(service_harness, "HTTP", request.param)
    return request.param
